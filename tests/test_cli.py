"""The ``foak`` command line as a user meets it (issue 13): kernels on by default, both spellings of every
argument with foak's defaults never overriding the user's, HF's precision flags, one-line errors (exit code 2),
hub ids, reproducible runs, exact summaries, ``foak --version``, ``foak verify`` refusing an empty PASS, the
docs' examples as written (docs/train.md, docs/lora.md), LICENSE / extras.

Training runs here force foak's reference backend (``reference`` fixture): these tests are about the command
line, and the kernels' numerics are tested elsewhere (in the interpreter); a patched run is still compared
with the unpatched one where the numbers are the point. Most go through ``main([...])`` in-process; one
subprocess checks the real exit code and stderr."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import foak
from foak.cli import main
from foak.data import char_tokenizer
from foak.models.tiny import tiny_model
from foak.train import EMBEDDED_DEFAULTS, TRAINER_DEFAULTS, parse_arguments, train

REPO = Path(__file__).resolve().parents[1]
# tiny runs: one or two steps of short sequences
FAST = ["--max_steps", "2", "--per_device_train_batch_size", "2", "--max_seq_length", "24", "--logging_steps", "1",
        "--warmup_steps", "0", "--learning_rate", "1e-2"]


@pytest.fixture
def reference():
    foak.set_backend("reference")
    yield
    foak.set_backend("auto")


def _save_tiny(path: Path, arch: str = "llama") -> Path:
    tokenizer = char_tokenizer()
    model = tiny_model(arch)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("cli") / "my-llama")


LINE = "the cat sees the ball."  # 22 characters: 24 tokens with bos and eos


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_data") / "data.jsonl"
    path.write_text("".join(json.dumps({"text": LINE}) + "\n" for _ in range(32)))
    return path


def _errors(capsys) -> list[str]:
    """stderr's lines, less transformers' progress bars (loading, writing) when the error came after a load."""
    return [line for line in capsys.readouterr().err.splitlines() if line.strip() and "it/s]" not in line]


def _one_line_error(capsys, argv, match: str, command: str = "train") -> str:
    capsys.readouterr()  # what came before
    assert main(argv) == 2, argv
    err = _errors(capsys)
    assert len(err) == 1 and err[0].startswith(f"foak {command}: error: "), err
    assert re.search(match, err[0]), err[0]
    return err[0]


# ---- 1. kernels on by default --------------------------------------------------------------------------
def test_a_model_of_yours_gets_every_kernel_by_default_and_none_is_the_baseline(model_dir, data, tmp_path, capsys,
                                                                             reference):
    args = [*FAST, "--model", str(model_dir), "--dataset", str(data)]
    patched = train([*args, "--output_dir", str(tmp_path / "a")])
    out = capsys.readouterr().out
    assert "foak kernels: every switch foak has for llama (fast_rms_layernorm, fast_rope_embeddings, fast_swiglu, " \
           "fused_linear_loss, fast_packed_attention)" in out
    report = patched["patch_report"]
    for rule, modules in [("rms_norm", 5), ("rope", 2), ("swiglu", 2), ("fused_linear_loss", 1)]:
        assert re.search(rf"llama\.{rule} +{rule} +{modules} ", report), (rule, report)
    # the baseline, every option spelled with dashes: the user's values are the run's (2 steps into b/)
    dashed = [a.replace("_", "-") if a.startswith("--") else a for a in args]
    baseline = train([*dashed, "--acceleration-config", "none", "--output-dir", str(tmp_path / "b")])
    assert baseline["patch_report"] is None and "training without foak's kernels (the baseline)" in \
        capsys.readouterr().out
    assert baseline["steps"] == 2 and (tmp_path / "b" / "model.safetensors").is_file()
    assert [h["step"] for h in baseline["log_history"] if "loss" in h] == [1, 2]  # --logging-steps 1
    # the same seed and batches: foak's step-1 loss is the unpatched model's
    assert abs(patched["first_loss"] - baseline["first_loss"]) <= 1e-5 * baseline["first_loss"]
    assert "fused_linear_loss" in patched["plot_title"] and "baseline" in baseline["plot_title"]


def test_an_unsupported_architecture_fails_before_the_data_is_read(tmp_path, capsys):
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64))
    gpt2.save_pretrained(tmp_path / "gpt2")
    char_tokenizer().save_pretrained(tmp_path / "gpt2")
    argv = ["train", "--model", str(tmp_path / "gpt2"), "--dataset", str(tmp_path / "missing.jsonl")]
    _one_line_error(capsys, argv, r"no kernels for model_type 'gpt2' .*pass --acceleration_config none")
    # without foak the same command gets as far as the data
    _one_line_error(capsys, [*argv, "--acceleration_config", "none"], "dataset file not found")


def test_foak_patch_without_a_config_enables_every_switch_for_the_model():
    import peft

    from foak.api import default_config
    from foak.verify import fixed_batch

    model = tiny_model("llama")
    batch = fixed_batch(model.config.vocab_size)
    expected = model(**batch).loss
    report = foak.patch(model)
    assert {r.switch for r in report.results if r.modules} == {"rms_norm", "rope", "swiglu", "fused_linear_loss",
                                                               "packed_attention"}
    assert abs(model(**batch).loss - expected) <= 1e-5 * expected  # the kernels, in the interpreter
    # a PEFT model: the peft stanza, fused_lora included
    lora = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    cfg = default_config(lora)
    assert cfg.mode == "peft" and cfg.fused_lora and cfg.fused_linear_loss and not cfg.fast_loss
    # what the architecture has: GPTBigCode only the loss; a head behind a logit softcap takes fast_loss
    assert default_config(tiny_model("gpt_bigcode")).enabled_rules() == {"fused_linear_loss"}
    assert default_config(tiny_model("mixtral")).enabled_rules() == {"rms_norm", "rope", "moe", "fused_linear_loss",
                                                                     "packed_attention"}
    capped = tiny_model("llama")
    capped.config.final_logit_softcapping = 30.0
    assert default_config(capped).enabled_rules() == {"rms_norm", "rope", "swiglu", "loss", "packed_attention"}
    with pytest.raises(ValueError, match="no rules for model_type 'gpt2'"):
        foak.patch(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2)))


def test_default_config_overrides_replace_only_the_switches_given():
    import peft

    from foak.api import default_config

    lora = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    cfg = default_config(lora, tiled_mlp=True, fast_rope_embeddings=False)
    assert cfg.mode == "peft" and cfg.enabled_rules() == default_config(lora).enabled_rules() - {"rope"} | {"tiled_mlp"}
    with pytest.raises(ValueError, match="tiled_mlpp"):
        default_config(lora, tiled_mlpp=True)


# ---- 2. both spellings, foak's defaults never override, --help ------------------------------------------
def test_both_spellings_of_every_option_and_no_default_overrides_the_user(tmp_path):
    given = {"output_dir": str(tmp_path / "dash"), "report_to": "tensorboard", "save_strategy": "steps",
             "logging_steps": "3", "per_device_train_batch_size": "3", "max_steps": "7", "learning_rate": "0.25",
             "warmup_steps": "2", "max_seq_length": "33", "lora_r": "5", "acceleration_config": "none"}
    assert set(TRAINER_DEFAULTS) | set(EMBEDDED_DEFAULTS) <= set(given)
    for spell in (lambda k: k, lambda k: k.replace("_", "-")):
        for argv in ([x for k, v in given.items() for x in (f"--{spell(k)}", v)],
                     [f"--{spell(k)}={v}" for k, v in given.items()]):
            foak_args, args = parse_arguments(argv)
            got = {"output_dir": args.output_dir, "report_to": args.report_to, "save_strategy": args.save_strategy,
                   "logging_steps": args.logging_steps, "per_device_train_batch_size": args.per_device_train_batch_size,
                   "max_steps": args.max_steps, "learning_rate": args.learning_rate,
                   "warmup_steps": args.warmup_steps, "max_seq_length": foak_args.max_seq_length,
                   "lora_r": foak_args.lora_r, "acceleration_config": foak_args.acceleration_config}
            assert got == {"output_dir": str(tmp_path / "dash"), "report_to": ["tensorboard"], "save_strategy": "steps",
                           "logging_steps": 3, "per_device_train_batch_size": 3, "max_steps": 7,
                           "learning_rate": 0.25, "warmup_steps": 2, "max_seq_length": 33, "lora_r": 5,
                           "acceleration_config": "none"}, (argv, got)
    # foak's defaults where nothing is given; every option with an underscore also takes dashes
    foak_args, args = parse_arguments([])
    assert (args.output_dir, args.max_steps, args.logging_steps, args.report_to) == ("foak-output", 60, 5, [])
    from foak.train import build_parser

    for action in build_parser(embedded=False)._actions:
        long = [o for o in action.option_strings if o.startswith("--") and "_" in o]
        for option in long:
            assert option.replace("_", "-") in action.option_strings, option


def test_help_is_short_with_foaks_defaults_and_help_all_has_hfs_long_tail(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 80
    for text in ("examples:", "foak train --model ./my-llama", "--lora_r", "--lora_alpha", "--target_modules",
                 "--acceleration_config", "--torch_dtype", "[default foak-output]", "embedded default run: 60",
                 "--max-steps", "--debug"):
        assert text in out, text
    assert "--adam_beta1" not in out
    assert main(["train", "--help_all"]) == 0
    full = capsys.readouterr().out
    assert "--adam_beta1" in full and "foak-output" in full and len(full.splitlines()) > 300


# ---- 3. precision flags ---------------------------------------------------------------------------------
def test_bf16_is_autocast_over_fp32_master_weights(model_dir, data, tmp_path, reference):
    from foak.train import load_model_and_tokenizer

    start = load_file(model_dir / "model.safetensors")
    train([*FAST, "--model", str(model_dir), "--dataset", str(data), "--bf16", "--learning_rate", "2e-5",
           "--output_dir", str(tmp_path)])
    trained = load_file(tmp_path / "model.safetensors")
    projections = [n for n in start if n.endswith("proj.weight")]
    assert all(trained[n].dtype == torch.float32 for n in projections)
    changed = sum(int((trained[n] != start[n]).sum()) for n in projections)
    total = sum(start[n].numel() for n in projections)
    assert changed / total > 0.95, changed / total  # bf16 weights would round most 2e-5 updates away
    # pure bf16 weights are their own option; fp16 weights cannot be fully fine-tuned
    model, _, _ = load_model_and_tokenizer(*parse_arguments(["--model", str(model_dir), "--torch_dtype", "bfloat16"]))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_fp16_loads_fp32_weights_and_a_contradicting_stanza_is_an_error(model_dir, data, tmp_path, capsys):
    from foak.train import check_run_precision, weights_dtype

    foak_args, args = parse_arguments(["--model", str(model_dir), "--fp16"])
    assert weights_dtype(foak_args, args) == torch.float32
    check_run_precision(foak_args, args, None)  # fp32 master weights + fp16 autocast: fine
    base = ["train", "--model", str(model_dir), "--dataset", str(data), "--output_dir", str(tmp_path)]
    _one_line_error(capsys, [*base, "--fp16", "--torch_dtype", "float16"],
                    r"--torch_dtype float16 with --fp16: fp16 weights with full fine-tuning")
    if not torch.cuda.is_available():
        _one_line_error(capsys, [*base, "--fp16"], r"--fp16 needs a CUDA GPU.*use --bf16")
    # the QLoRA base follows the autocast dtype (bitsandbytes' compute dtype)
    foak_args, args = parse_arguments(["--peft", "qlora-nf4", "--bf16"])
    assert weights_dtype(foak_args, args, quantized=True) == torch.bfloat16
    # --peft decides PEFT or full fine-tuning: a stanza that says otherwise is an error
    full = tmp_path / "full.yaml"
    full.write_text("training:\n  fused_ops_and_kernels:\n    fast_rms_layernorm: true\n")
    peft_yaml = tmp_path / "peft.yaml"
    peft_yaml.write_text("peft:\n  quantization:\n    fused_ops_and_kernels:\n      fused_lora: true\n")
    _one_line_error(capsys, [*base, "--peft", "lora", "--acceleration_config", str(full)],
                    r"--peft lora with --acceleration_config .* stanza is for full fine-tuning")
    _one_line_error(capsys, [*base, "--acceleration_config", str(peft_yaml)], r"but --peft is none")


# ---- 4. one-line errors, --debug, model sources ------------------------------------------------------------
def test_user_errors_are_one_line_on_stderr_with_exit_code_2(model_dir, data, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "a_file").write_text("x")
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for f in ("config.json", "model.safetensors"):
        (no_tokenizer / f).write_bytes((model_dir / f).read_bytes())
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text('{"text": "ok"}\n{not json\n{"txt": 1}\n')
    typo = tmp_path / "foak.yaml"
    typo.write_text("training:\n  fused_ops_and_kernels:\n    fast_rsm_layernorm: true\n")
    m = ["--model", str(model_dir)]
    cases = [
        (["--dataset", str(tmp_path / "nope.jsonl")], "dataset file not found"),
        (["--dataset", str(bad_data)], r"2 malformed line\(s\): line 2: not valid JSON.*; line 3: expected a string"),
        (["--model", "./no-such-model"], r"--model ./no-such-model: no such directory"),
        (["--model", str(tmp_path / "empty")], r"is a directory but not a Hugging Face model: it has no config.json"),
        (["--model", str(tmp_path / "weightless")], r"has a config.json but no weights"),
        (["--model", str(tmp_path / "a_file")], r"is a file, not a model directory"),
        (["--model", str(no_tokenizer)], r"has no tokenizer files"),
        (["--model", "not a/valid id"], r"no such local directory, and not a hub id"),
        ([*m, "--acceleration_config", str(typo)], r"did you mean 'fast_rms_layernorm'"),
        ([*m, "--acceleration_config", str(tmp_path / "missing.yaml")], r"no such config file"),
        (["--peft", "qlora"], r"--peft must be none, lora or qlora-nf4"),
        (["--max_stesp", "3"], r"unrecognized argument\(s\): --max_stesp 3; did you mean --max_steps"),
        (["--max_steps", "three"], r"argument --max_steps/--max-steps: invalid int value: 'three'"),
        ([*m, "--dataset", str(data), "--peft", "lora", "--target_modules", "qkv"], r"match no linear layer"),
    ]
    for argv, match in cases:
        _one_line_error(capsys, ["train", *argv, "--output_dir", str(tmp_path / "out")], match)
    # --debug adds the traceback, the exit code stays 2
    assert main(["train", "--peft", "qlora", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1].startswith("foak train: error")
    # verify and the top level too
    _one_line_error(capsys, ["verify", "--model", str(tmp_path / "empty")], "it has no config.json", "verify")
    _one_line_error(capsys, ["verify", "--dtype", "fp8"], "argument --dtype: invalid choice", "verify")


def test_the_real_exit_code_and_stderr_of_a_directory_that_is_not_a_model(tmp_path):
    # foak verify: the same error path as foak train's (main's return value is the exit status), without
    # importing transformers first
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "notes.txt").write_text("hello")
    run = subprocess.run([sys.executable, "-m", "foak.cli", "verify", "--model", "not-a-model"], capture_output=True,
                         text=True, cwd=tmp_path, env={**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 2, run
    assert run.stderr.strip().splitlines() == [
        "foak verify: error: --model not-a-model is a directory but not a Hugging Face model: it has no config.json"
    ], run.stderr


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, model_dir):
    """A local hub cache holding foak-test/tiny-llama (the tiny Llama), as hf download would leave it."""
    import huggingface_hub.constants as constants

    repo = tmp_path / "hub" / "models--foak-test--tiny-llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return constants


def test_hub_ids_load_from_the_cache_offline_and_fail_fast_when_the_hub_is_unreachable(hub_cache, data, tmp_path,
                                                                                    monkeypatch, capsys, reference):
    from foak.model_source import resolve_model

    monkeypatch.setattr(hub_cache, "HF_HUB_OFFLINE", True)
    out = tmp_path / "out"
    summary = train([*FAST, "--max_steps", "1", "--model", "foak-test/tiny-llama", "--dataset", str(data),
                     "--peft", "lora", "--lora_r", "2", "--output_dir", str(out)])
    assert summary["steps"] == 1 and summary["fused_lora"]["fused"] > 0
    # the adapter records the hub id as its base
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "foak-test/tiny-llama"
    _one_line_error(capsys, ["train", "--model", "foak-test/not-cached"],
                    r"not in the local hub cache, and HF_HUB_OFFLINE is set")
    # online, but the hub cannot be reached: one request, no retries, one line
    monkeypatch.setattr(hub_cache, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_cache, "ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"cannot reach the Hugging Face hub at http://127.0.0.1:9 .*not in the "
                                         r"local cache.*HF_HUB_OFFLINE=1"):
        resolve_model("foak-test/not-cached")
    assert time.perf_counter() - start < 5
    # ... and a cached model is used from the cache (with a warning)
    assert resolve_model("foak-test/tiny-llama").local_files_only


# ---- 5. reproducible runs; 6. summary, logging, adapter base ------------------------------------------------
def test_identical_lora_runs_give_identical_losses_and_the_summary_counts_exactly(model_dir, data, tmp_path,
                                                                                monkeypatch, capsys, reference):
    monkeypatch.chdir(model_dir.parent)
    args = ["--model", "my-llama", "--dataset", str(data), "--peft", "lora", "--lora_r", "4", "--lora_dropout", "0.1",
            "--max_steps", "3", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--logging_steps", "1", "--learning_rate", "1e-2"]

    def run(name, *extra):
        summary = train([*args, *extra, "--output_dir", str(tmp_path / name)])
        history = [(h["step"], h["loss"], h["grad_norm"]) for h in summary["log_history"] if "loss" in h]
        return summary, history, load_file(tmp_path / name / "adapter_model.safetensors")

    first, history, adapter = run("a")
    again, history_again, adapter_again = run("b")
    assert len(history) == 3 and history == history_again
    assert adapter.keys() == adapter_again.keys() and all(torch.equal(adapter[k], adapter_again[k]) for k in adapter)
    other, history_other, _ = run("c", "--seed", "1")
    assert history_other[0][1:] != history[0][1:]  # the seed reaches the adapter's initialisation
    # exact token counts: 3 steps x 2 micro-batches x 2 sequences of 24 tokens (no batch prefetched ahead)
    assert first["tokens"] == 3 * 2 * 2 * (len(LINE) + 2)
    # the first loss is step 1's own (not a logging-interval mean): a run logging every 5 steps has it too
    quiet, _, _ = run("d", "--logging_steps", "5", "--log_level", "warning")
    assert abs(first["first_loss"] - history[0][1]) < 1e-4 and quiet["first_loss"] == first["first_loss"]
    out = capsys.readouterr().out
    assert out.count("foak patch report") == 6 and out.count("done: ") == 3  # --log_level warning: silent
    assert "loss_curve.png" in os.listdir(tmp_path / "a") and "my-llama, LoRA r4" in first["plot_title"]
    # the adapter records the absolute base path, not the relative one given
    base = json.loads((tmp_path / "a" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(model_dir.resolve())


def test_version_verify_refusals_and_the_bitsandbytes_cpu_warning(monkeypatch, capsys, caplog):
    import logging

    from foak.verify import verify_model

    with pytest.raises(SystemExit) as exit_info:
        from foak.cli import build_parser

        build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"foak {foak.__version__}"
    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == "foak 0.1.0"
    # foak verify compares something or fails
    _one_line_error(capsys, ["verify", "--rules"], "argument --rules: expected at least one argument", "verify")
    with pytest.raises(ValueError, match="no rule to check"):
        verify_model(tiny_model("llama"), [])
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the ops would run as their references only
    for argv in (["verify"], ["verify", "--ops"]):
        _one_line_error(capsys, argv, r"no CUDA GPU and TRITON_INTERPRET is not 1.*run TRITON_INTERPRET=1 foak verify",
                        "verify")
    monkeypatch.setenv("FOAK_BACKEND", "reference")
    _one_line_error(capsys, ["verify", "--ops"], "compare the reference ops with themselves", "verify")
    # bitsandbytes' CPU-kernel warning is dropped, its other warnings are not
    from foak.cli import BNB_CPU_WARNING, silence_bitsandbytes_cpu_warning

    silence_bitsandbytes_cpu_warning()
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        bnb.warning(BNB_CPU_WARNING + ": %s. Please make sure you already `pip install kernels`", "no module")
        bnb.warning("another bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records if r.name == bnb.name] == ["another bitsandbytes warning"]


# ---- 6/7. LICENSE, extras (the files the README and docs/ name: tests/test_docs.py) ---------------------------
def test_license_and_extras():
    import tomllib

    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    for extra in ("train", "qlora"):
        names = {re.split(r"[<>=; ]", r)[0] for r in project["optional-dependencies"][extra]}
        assert {"accelerate", "peft", "bitsandbytes"} <= names, extra


def _doc_block(page: str, heading: str, language: str) -> str:
    """The first ```language block (its info string may go on, e.g. "yaml runnable") under ``## heading`` of a
    docs page."""
    text = (REPO / page).read_text()
    section = text.split(f"\n## {heading}\n", 1)[1]
    return section.split(f"```{language}", 1)[1].split("\n", 1)[1].split("```", 1)[0]


def test_the_docs_gptq_recipe_trains_and_reloads_the_adapter(tmp_path, monkeypatch, reference):
    """The GPTQ block of docs/lora.md as written, in a directory holding ./my-llama and data.jsonl; only the train
    call gets --max_steps 2 and a larger learning rate (so that two steps move the adapter visibly)."""
    import foak.train as foak_train

    _save_tiny(tmp_path / "my-llama")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": f"{LINE} {i}"}) + "\n" for i in range(16)))
    monkeypatch.chdir(tmp_path)
    summaries = []
    real_train = foak_train.train
    monkeypatch.setattr(foak_train, "train", lambda argv: summaries.append(
        real_train([*argv, "--max_steps", "2", "--learning_rate", "1e-2"])) or summaries[-1])
    page = (REPO / "docs" / "lora.md").read_text()
    block = page.split("\nLoRA on a GPTQ 4-bit checkpoint,", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(block, "docs/lora.md (GPTQ block)", "exec"), namespace)
    assert (tmp_path / "my-llama-gptq" / "tokenizer.json").is_file()  # save_gptq wrote the tokenizer
    assert len(summaries) == 1 and summaries[0]["steps"] == 2
    trained, model, trainable = summaries[0]["model"].eval(), namespace["model"], namespace["trainable"]
    from foak.quant.gptq import GPTQLinear
    from foak.quant.gptq_peft import GPTQLoraLinear

    for m in (model, trainable):
        assert type(m).__name__ == "PeftModelForCausalLM"
        assert sum(isinstance(x, GPTQLoraLinear) for x in m.modules()) == 14
        assert sum(isinstance(x, GPTQLinear) for x in m.modules()) == 14
    ids = torch.tensor([char_tokenizer().encode(LINE)])
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        reloaded = model(input_ids=ids).logits  # float32, as trained (foak_gptq_base.json)
        with model.disable_adapter():
            base_only = model(input_ids=ids).logits
        explicit = trainable(input_ids=ids).logits  # bfloat16 base
    assert reloaded.dtype == torch.float32 and not model.training
    assert (reloaded - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert (base_only - expected).abs().max() > 1e-2 * expected.abs().max()  # the adapter matters
    lora = [p for n, p in trainable.named_parameters() if "lora_" in n]
    assert len(lora) == 28 and all(p.requires_grad for p in lora)
    assert (explicit.float() - expected).abs().max() <= 3e-2 * expected.abs().max()  # bf16


def test_the_docs_training_examples_run_as_written(tmp_path, monkeypatch, capsys, reference):
    """The commands of docs/train.md's Examples block, in a directory holding what they name (./my-llama,
    data.jsonl, pairs.jsonl, and foak.yaml: the training stanza of docs/configuration.md); only --max_steps 2 is
    appended."""
    _save_tiny(tmp_path / "my-llama")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": f"{LINE} {i}"}) + "\n" for i in range(16)))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"prompt": "q: the cat", "response": " sees."}) + "\n"
                                                  for _ in range(16)))
    (tmp_path / "foak.yaml").write_text(_doc_block("docs/configuration.md", "Where the switches come from", "yaml"))
    monkeypatch.chdir(tmp_path)
    block = _doc_block("docs/train.md", "Examples", "bash")
    commands = [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
    commands = [c for c in commands if c]
    assert len(commands) >= 2 and all(c[:2] == ["foak", "train"] for c in commands), commands
    for command in commands:
        assert main([*command[1:], "--max_steps", "2"]) == 0, command
        assert "done: 2 steps" in capsys.readouterr().out, command
