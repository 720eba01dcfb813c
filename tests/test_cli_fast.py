"""The command line answers before anything heavy is imported: ``import foak`` imports neither torch nor
transformers, ``foak --help`` / ``foak train --help`` / ``foak --version`` and foak train's argument errors
(unknown options, bad values, a missing or mistyped YAML, a bad --model path) come back from a process that
never imported them, each error one line on stderr with exit code 2; the light parser of foak train
(foak/train_cli.py, which reads the installed TrainingArguments' fields from transformers' source) takes
exactly the options HF's parser takes, with the same value kinds, and renders the same --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _python(code: str, cwd: Path) -> dict:
    """Run ``code`` in a fresh interpreter that imports this checkout's foak; its last stdout line is JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


HEAVY = ("torch", "transformers", "triton", "peft", "accelerate")


def test_import_foak_is_light_and_its_public_names_and_submodules_still_resolve(tmp_path):
    out = _python(f"""
        import json, sys
        import foak
        light = [m for m in {HEAVY!r} if m in sys.modules]
        names = sorted(foak.__all__)
        import foak.patching, foak.ops.rms_norm, foak.backend
        from foak.patching.replacements import FUSED_HEAD_HOOKS
        checks = {{
            "light": light,
            "resolved": [n for n in names if getattr(foak, n, None) is not None],
            "patch": foak.patch is foak.api.patch and foak.restore is foak.api.restore,
            "rms_norm": foak.rms_norm is foak.ops.rms_norm.rms_norm,
            "set_backend": foak.set_backend is foak.backend.set_backend,
            "submodule": foak.ops.rms_norm.__name__,
            "trl_hook": [h.__module__ for h in FUSED_HEAD_HOOKS],
            "dir": all(n in dir(foak) for n in names),
        }}
        try:
            foak.no_such_name
        except AttributeError as e:
            checks["missing"] = str(e)
        print(json.dumps(checks))
    """, tmp_path)
    assert out["light"] == []
    assert out["resolved"] == sorted(["__version__", "cross_entropy", "geglu", "get_backend", "glu_linear",
                                      "linear_cross_entropy", "lora_glu_linear", "lora_linear", "lora_linears",
                                      "patch", "restore", "rms_norm", "rope", "set_backend", "swiglu"])
    assert out["patch"] and out["rms_norm"] and out["set_backend"] and out["dir"]
    assert out["submodule"] == "foak.ops.rms_norm"
    # importing foak.patching (as foak.patch does) registers the TRL servers (fused head, distillation loss) once
    assert out["trl_hook"] == ["foak.integrations.trl", "foak.integrations.trl_distill"]
    assert out["missing"] == "module 'foak' has no attribute 'no_such_name'"


def test_help_version_and_argument_errors_come_before_torch_and_transformers(tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text("training:\n  fused_ops_and_kernels:\n    fast_rsm_layernorm: true\n")
    peft_stanza = tmp_path / "peft.yaml"
    peft_stanza.write_text("peft:\n  quantization:\n    fused_ops_and_kernels:\n      fused_lora: true\n")
    (tmp_path / "empty").mkdir()
    cases = [  # (argv, exit code, what stderr's one line says; None: the help or version on stdout)
        (["--help"], 0, None),
        (["--version"], 0, None),
        (["verify", "--help"], 0, None),
        (["train", "--help"], 0, None),
        (["train", "--max_stesp", "3"], 2, "unrecognized argument(s): --max_stesp 3; did you mean --max_steps"),
        (["train", "--max_steps", "three"], 2, "argument --max_steps/--max-steps: invalid int value: 'three'"),
        (["train", "--learning-rate", "fast"], 2, "invalid float value: 'fast'"),
        (["train", "--lora_r", "x"], 2, "argument --lora_r/--lora-r: invalid int value: 'x'"),
        (["train", "--bf16", "maybe"], 2, "Truthy value expected: got maybe"),
        (["train", "--peft", "qlora"], 2, "--peft must be none, lora or qlora-nf4, got 'qlora'"),
        (["train", "--torch_dtype", "fp8"], 2, "--torch_dtype must be one of float32, bfloat16, float16"),
        (["train", "--max_seq_length", "0"], 2, "--max_seq_length must be a positive number of tokens"),
        (["train", "--output_dir", "x", "stray"], 2, "unrecognized argument(s): stray"),
        (["train", "--acceleration_config", str(tmp_path / "missing.yaml")], 2, "no such config file"),
        (["train", "--acceleration_config", str(typo)], 2, "did you mean 'fast_rms_layernorm'"),
        (["train", "--acceleration_config", str(peft_stanza)], 2, "but --peft is none"),
        (["train", "--long_context", "--gradient_checkpointing", "false"], 2, "--long_context needs gradient"),
        (["train", "--long_context", "--activation-checkpointing=no"], 2,
         "inputs): drop --activation-checkpointing=no"),  # (the flag as given, not --gradient_checkpointing false)
        (["train", "--long_context", "--acceleration_config", "None"], 2,
         "--long_context adds foak's offload_activations and tiled_mlp, which --acceleration_config none turns off"),
        (["train", "--model", "./no-such-model"], 2, "--model ./no-such-model: no such directory"),
        (["train", "--model", str(tmp_path / "empty")], 2, "it has no config.json"),
        (["bogus"], 2, "argument command: invalid choice: 'bogus'"),
    ]
    out = _python(f"""
        import contextlib, io, json, sys
        from foak.cli import main
        results = []
        for argv, *_ in {cases!r}:
            stdout, stderr = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                code = main(argv)
            results.append([code, stdout.getvalue(), stderr.getvalue()])
        results.append([m for m in {HEAVY!r} if m in sys.modules])
        print(json.dumps(results))
    """, tmp_path)
    assert out.pop() == [], "a heavy module was imported"
    for (argv, code, error), (got_code, stdout, stderr) in zip(cases, out):
        assert got_code == code, (argv, got_code, stderr)
        if error is None:
            assert stdout and not stderr, argv
            continue
        prefix = "foak train: error: " if argv[0] == "train" else "foak: error: "
        assert len(stderr.splitlines()) == 1 and stderr.startswith(prefix) and error in stderr, (argv, stderr)
    help_out = out[[c[0] for c in cases].index(["train", "--help"])][1]
    assert "--acceleration_config" in help_out and "[default foak-output]" in help_out
    assert out[1][1].strip().startswith("foak ")  # --version


def test_the_light_parser_takes_what_hfs_parser_takes():
    from transformers import HfArgumentParser, TrainingArguments

    from foak.train import build_parser
    from foak.train_cli import COMMON_TRAINING_ARGUMENTS, FoakArguments, light_parser, training_argument_specs

    assert training_argument_specs() is not None  # the installed transformers' source was read
    hf = build_parser(embedded=False)
    light = {tuple(a.option_strings): a for a in light_parser()._actions}
    compared = 0
    for action in hf._actions:
        if action.dest == "help":
            continue
        mine = light.get(tuple(action.option_strings))
        assert mine is not None, action.option_strings
        assert (mine.dest, mine.nargs, mine.const) == (action.dest, action.nargs, action.const), action.option_strings
        if action.type in (int, float) or mine.type in (int, float):
            assert mine.type is action.type, action.option_strings
        if mine.choices is not None:
            assert list(mine.choices) == list(action.choices), action.option_strings
        compared += 1
    assert compared == len(light) == len([a for a in hf._actions if a.dest != "help"])
    # every TrainingArguments field is there (not only those foak's parser happens to know)
    assert {s.name for s in training_argument_specs()} == {
        f.name for f in __import__("dataclasses").fields(TrainingArguments) if f.init}
    assert HfArgumentParser  # (the parser build_parser extends)
    # the defaults --help shows are HF's (foak's where it sets them)
    by_dest = {a.dest: a for a in hf._actions}
    light_by_dest = {a.dest: a for a in light_parser()._actions}
    for dest in [*COMMON_TRAINING_ARGUMENTS, *FoakArguments.__dataclass_fields__]:
        if dest not in ("dataloader_pin_memory", "use_cpu"):
            assert light_by_dest[dest].default == by_dest[dest].default, dest


def test_the_short_help_is_the_one_hfs_parser_would_render(monkeypatch):
    import foak.train_cli as train_cli

    light = train_cli.help_text()
    monkeypatch.setattr(train_cli, "training_argument_specs", lambda: None)  # falls back to HF's parser
    assert train_cli.help_text() == light


@pytest.mark.parametrize("annotation, default, expected", [
    ("bool", "False", ("?", True, "string_to_bool", False, ())),
    ("bool", "True", ("?", True, "string_to_bool", True, ("--no_x_y", "--no-x-y"))),
    ("bool | None", "None", (None, None, "string_to_bool", None, ())),
    ("Optional[int]", "None", (None, None, "int", None, ())),
    ("float", "5e-05", (None, None, "float", 5e-05, ())),
    ("list[str] | None", "None", ("+", None, "str", None, ())),
    ("SchedulerType | str", "'linear'", (None, None, "str", "linear", ())),
    ("None | str | list[str]", "'none'", (None, None, "str", "none", ())),
    ("Union[str, list[int]]", "''", ("+", None, "int", "", ())),
])
def test_a_fields_annotation_becomes_the_option_hf_makes_of_it(annotation, default, expected):
    import ast

    from foak.train_cli import _spec_of_field

    node = ast.parse(f"x_y: {annotation} = field(default={default}, metadata={{'help': 'h'}})").body[0]
    spec = _spec_of_field("x_y", node.annotation, node.value, {})
    assert spec.options == ("--x_y", "--x-y")
    assert (spec.nargs, spec.const, spec.type.__name__, spec.default, spec.negation) == expected
    init_false = ast.parse("x: int = field(default=0, init=False)").body[0]
    assert _spec_of_field("x", init_false.annotation, init_false.value, {}) is None


def test_a_run_that_offloads_pins_host_memory_by_cuda_host_register_set_before_torch(tmp_path):
    """foak train with offload_activations (--long_context or the YAML) adds torch's cudaHostRegister pinning to
    the allocator settings before torch is imported (the first step pins every offloaded layer input: on the
    H200 machine 7.7 GiB/s that way vs 2.0 by cudaHostAlloc); settings the user gave are kept, the variable the
    user set is the one extended, and a run that does not offload leaves the environment alone."""
    yaml_file = tmp_path / "offload.yaml"
    yaml_file.write_text("training:\n  fused_ops_and_kernels:\n    offload_activations: true\n")
    out = _python(f"""
        import json, os, sys
        from foak.train_cli import check_arguments, pinned_host_allocation

        def case(argv, env):
            env = dict(env)
            note = pinned_host_allocation(check_arguments(argv), env)
            return {{"note": note, "env": env}}

        cases = {{
            "long_context": case(["--long_context"], {{}}),
            "yaml": case(["--acceleration_config", {str(yaml_file)!r}, "--gradient_checkpointing"], {{}}),
            "kept": case(["--long_context"], {{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}),
            "user_register": case(["--long_context"], {{"PYTORCH_CUDA_ALLOC_CONF":
                                  "pinned_use_cuda_host_register:False,pinned_num_register_threads:2"}}),
            "new_name": case(["--long_context"], {{"PYTORCH_ALLOC_CONF": "expandable_segments:True"}}),
            "no_offload": case([], {{}}),
            "baseline": case(["--acceleration_config", "none"], {{}}),
        }}
        print(json.dumps({{"cases": cases, "torch": "torch" in sys.modules}}))
    """, tmp_path)
    cases = out["cases"]
    assert not out["torch"]
    both = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
    for name in ("long_context", "yaml"):
        assert cases[name]["env"] == {"PYTORCH_CUDA_ALLOC_CONF": both}, name
        assert "cudaHostRegister" in cases[name]["note"] and both in cases[name]["note"]
    assert cases["kept"]["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True," + both}
    assert cases["user_register"] == {"note": None, "env": {
        "PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False,pinned_num_register_threads:2"}}
    assert cases["new_name"]["env"] == {"PYTORCH_ALLOC_CONF": "expandable_segments:True," + both}
    assert cases["no_offload"] == {"note": None, "env": {}} and cases["baseline"] == {"note": None, "env": {}}


def test_pinned_host_allocation_after_torch_is_imported_changes_nothing_and_says_what_to_set():
    from foak.train_cli import check_arguments, pinned_host_allocation

    import torch  # noqa: F401  (imported: torch may have read its allocator settings already)

    env = {}
    note = pinned_host_allocation(check_arguments(["--long_context"]), env)
    assert env == {}
    assert note.startswith("offload_activations pins host memory faster with PYTORCH_CUDA_ALLOC_CONF="
                           "pinned_use_cuda_host_register:True,pinned_num_register_threads:8 set before")
