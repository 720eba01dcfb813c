"""foak bench: scenario validation and expansion, a real CPU run of the bundled smoke scenario (with an
experiment that gets SIGKILLed in the middle), the report files, and foak bench compare's exit codes."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from foak.bench.report import compare, read_csv
from foak.bench.scenario import bundled_scenarios, expand, load_scenario, parse_scenario
from foak.cli import main as cli_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _error(data) -> str:
    with pytest.raises(ValueError) as err:
        parse_scenario(data, "scenario file 's.yaml'")
    return str(err.value)


def test_validation_errors_name_the_bad_key():
    base = {"name": "s", "frameworks": ["none", "foak"]}
    msg = _error({**base, "sweeps": [{"model": "tiny"}, {"model": "tiny", "batch_sise": 4}]})
    assert msg.startswith("scenario file 's.yaml': sweeps[1].batch_sise: unknown key; did you mean 'batch_size'?")
    msg = _error({**base, "sweeps": [{"model": "tiny", "batch_size": [2, "four"]}]})
    assert "sweeps[0].batch_size[1]: expected a positive integer, got str 'four'" in msg
    msg = _error({**base, "defaults": {"precision": "bf17"}, "sweeps": [{"model": "tiny"}]})
    assert "defaults.precision: expected one of bf16, fp32, bf16-autocast, fp16-autocast, got str 'bf17'" in msg
    msg = _error({**base, "sweeps": [{"model": "tiny", "packing": "yes"}]})
    assert "sweeps[0].packing: expected a boolean (true or false), got str 'yes'" in msg
    msg = _error({**base, "sweeps": [{"model": "tiny", "gpus": 0}]})
    assert "sweeps[0].gpus: must be positive, got 0" in msg
    msg = _error({"name": "s", "framworks": ["none"]})
    assert "framworks: unknown key; did you mean 'frameworks'?" in msg
    msg = _error({**base, "models": {"mine": {"pth": "./x"}}, "sweeps": [{"model": "mine"}]})
    assert "models.mine.pth: unknown key; did you mean 'path'?" in msg
    msg = _error({**base, "sweeps": [{"model": "llama1bb"}]})
    assert "sweeps[0].model: unknown model 'llama1bb'; did you mean 'llama1b'?" in msg
    msg = _error({"name": "s", "frameworks": ["none", "lgier"], "sweeps": [{"model": "tiny"}]})
    assert "frameworks[1]: framework 'lgier': give its kind" in msg
    msg = _error({"name": "s", "frameworks": ["none", {"name": "f", "kind": "foak", "switches": {"fast_rms": True}}]})
    assert "unknown switch 'fast_rms'; did you mean" in msg and "'f'" in msg
    msg = _error({**base, "models": {"mine": {"path": "/no/such/model/dir"}}, "sweeps": [{"model": "mine"}]})
    assert "models.mine.path: '/no/such/model/dir' is not a directory" in msg
    msg = _error({**base, "baseline": "liger", "sweeps": [{"model": "tiny"}]})
    assert "baseline: 'liger' is not one of the frameworks (none, foak)" in msg


def test_validation_error_through_the_cli(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nframeworks: [none]\nsweeps:\n  - {model: tiny, seq_lenght: 32}\n")
    assert cli_main(["bench", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "foak bench: error:" in err and "sweeps[0].seq_lenght: unknown key; did you mean 'seq_length'?" in err
    assert cli_main(["bench", str(tmp_path / "missing.yaml")]) == 2
    assert "bundled: " in capsys.readouterr().err


def test_expansion_and_bundled_scenarios():
    scenario = parse_scenario({
        "name": "m", "frameworks": ["none", "liger", "foak"],
        "defaults": {"precision": "bf16", "timed_steps": 8},
        "sweeps": [{"model": "llama1b", "packing": [False, True]},
                   {"model": "llama8b-8l", "peft": ["lora", "qlora-nf4"], "lora_r": [8, 16], "frameworks": ["foak"]}]})
    ids = [e["experiment"] for e in expand(scenario)]
    assert len(ids) == 2 * 3 + 4 and len(set(ids)) == len(ids)
    assert ids[:3] == ["llama1b/b4xs4096/bf16/none", "llama1b/b4xs4096/bf16/liger", "llama1b/b4xs4096/bf16/foak"]
    assert ids[3] == "llama1b/b4xs4096/bf16/packed/none"
    assert ids[6:] == ["llama8b-8l/lora/b2xs4096/bf16/lora_r=8/foak", "llama8b-8l/lora/b2xs4096/bf16/foak",
                       "llama8b-8l/qlora-nf4/b2xs4096/bf16/lora_r=8/foak", "llama8b-8l/qlora-nf4/b2xs4096/bf16/foak"]
    with pytest.raises(ValueError, match=r"sweeps\[1\] repeats experiment llama1b/b4xs4096/bf16/none"):
        expand(parse_scenario({"name": "d", "frameworks": ["none"], "sweeps": [{"model": "llama1b"}] * 2}))
    bundled = bundled_scenarios()
    assert {"headline", "peft", "moe", "smoke"} <= set(bundled)
    counts = {name: len(expand(load_scenario(name))) for name in bundled}
    assert counts["headline"] == 15 and counts["smoke"] == 2  # the README table's 5 rows x 3 frameworks
    headline = [e["experiment"] for e in expand(load_scenario("headline"))]
    assert "llama8b-8l/b2xs4096/bf16/ckpt/foak" in headline and "llama1b/b4xs4096/bf16/packed/liger" in headline


CRASH_MODULE = '''
import os, signal

def kill(model, experiment):  # what the kernel's OOM killer does to a process
    os.kill(os.getpid(), signal.SIGKILL)
'''


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_smoke_scenario_end_to_end(tmp_path, capsys):
    """The bundled smoke scenario run for real on CPU (tiny Llama, HF vs foak, 4 steps each, each in its own
    process), with an experiment between the two that is SIGKILLed: recorded, and the next one still runs."""
    (tmp_path / "bench_crash_helper.py").write_text(CRASH_MODULE)
    data = yaml.safe_load(bundled_scenarios()["smoke"].read_text())
    assert data["frameworks"] == ["none", "foak"]
    data["frameworks"] = ["none", {"name": "crash", "kind": "python", "callable": "bench_crash_helper:kill",
                                   "env": {"PYTHONPATH": str(tmp_path)}}, "foak"]
    scenario_file = tmp_path / "smoke_with_crash.yaml"
    scenario_file.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    assert cli_main(["bench", str(scenario_file), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[2/3]" in printed and "killed (SIGKILL" in printed

    rows = _rows(out / "results.csv")
    assert [r["framework"] for r in rows] == ["none", "crash", "foak"]
    assert [r["status"] for r in rows] == ["ok", "killed", "ok"]
    assert "SIGKILL" in rows[1]["error"]
    for r in (rows[0], rows[2]):
        assert float(r["tokens_per_s"]) > 0 and float(r["step_ms"]) > 0 and float(r["first_step_s"]) > 0
        assert float(r["peak_rss_gib"]) > 0.05 and r["peak_allocated_gib"] == ""  # CPU: no torch CUDA peaks
        assert int(r["tokens_per_step"]) == 2 * 32 and r["device_name"] == "cpu"
        # the throughput is the timed steps' tokens over their time
        assert math.isclose(float(r["tokens_per_s"]) * float(r["step_ms"]) / 1e3, 64, rel_tol=1e-3)
    report = json.loads((out / "results.json").read_text())
    env = report["environment"]
    for key in ("gpu", "driver", "torch", "triton", "transformers", "foak", "foak_commit", "date_utc"):
        assert key in env
    assert env["torch"] and env["triton"] and env["transformers"] and env["foak"]
    ok = [r for r in report["results"] if r["status"] == "ok"]
    for r in ok:
        assert len(r["losses"]) == 1 + 3 and all(math.isfinite(x) for x in r["losses"])
        assert len(r["step_times_ms"]) == 3
    # same weights, same batches: foak's reference ops give the unpatched model's losses
    hf, fo = ok[0]["losses"], ok[1]["losses"]
    assert abs(hf[0] - math.log(301)) < 0.5  # random tokens over a 301-token vocabulary
    assert max(abs(a - b) for a, b in zip(hf, fo)) < 1e-4
    assert "llama.fused_linear_loss" in ok[1]["patch_report"]
    for name in ("throughput.png", "memory.png", "loss.png"):
        blob = (out / name).read_bytes()
        assert blob[:8] == PNG_MAGIC and len(blob) > 5000
    summary = (out / "summary.md").read_text()
    assert "| experiment | none tokens/s · peak GiB | crash tokens/s · peak GiB | foak tokens/s" in summary
    assert "killed" in summary and "x, " in summary

    # compare: the run against itself passes, against a doctored reference (foak 1.5x faster there) fails
    results = str(out / "results.csv")
    assert cli_main(["bench", "compare", results, results]) == 0
    assert "0 regression(s)" in capsys.readouterr().out
    doctored = tmp_path / "ref.csv"
    fieldnames = list(rows[0])
    for r in rows:
        if r["framework"] == "foak":
            r["tokens_per_s"] = str(float(r["tokens_per_s"]) * 1.5)
    with open(doctored, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)
    assert cli_main(["bench", "compare", results, str(doctored)]) == 1
    text = capsys.readouterr().out
    assert "| tokens_per_s |" in text and "-33.3% | 10.0% | REGRESSION |" in text
    assert "1 regression(s) beyond 10%" in text
    assert cli_main(["bench", "compare", results, str(doctored), "--threshold", "0.4"]) == 0
    # the summary and plots again from results.json
    for name in ("throughput.png", "memory.png", "loss.png", "summary.md"):
        (out / name).unlink()
    assert cli_main(["bench", "report", str(out)]) == 0
    assert (out / "loss.png").read_bytes()[:8] == PNG_MAGIC and (out / "summary.md").read_text() == summary


def _write(path: Path, rows: list[dict]) -> str:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def test_compare_rules(tmp_path):
    def row(exp, status="ok", tps=1000.0, mem=10.0, noise=0.02, loss=2.0):
        return {"experiment": exp, "status": status, "error": "" if status == "ok" else "boom",
                "tokens_per_s": tps, "tokens_per_s_noise": noise, "step_ms": 1e6 / tps, "step_ms_noise": noise,
                "peak_allocated_gib": mem, "peak_reserved_gib": mem + 1, "final_loss": loss}

    ref = _write(tmp_path / "ref.csv", [row("a"), row("b"), row("c"), row("d", status="failed")])
    # a: 5% slower (within 10%); b: 15% more memory; c: failed now; d failed in the reference too (ignored)
    new = _write(tmp_path / "new.csv", [row("a", tps=950.0), row("b", mem=11.5), row("c", status="oom"),
                                        row("d", status="failed"), row("e")])
    lines, regressions = compare(new, ref)
    assert regressions == 3  # b's allocated and reserved peaks, c's status
    text = "\n".join(lines)
    assert "| b | peak_allocated_gib | 10 | 11.5 | +15.0% | 10.0% | REGRESSION |" in text
    assert "| c | status | ok | oom: boom |" in text and "| e | | (not in the reference) | ok |" in text
    assert "| a | tokens_per_s | 1000 | 950 | -5.0% | 10.0% | ok |" in text
    # with the reference's noise band (2%) a's 5% slowdown regresses (tokens/s and step time)
    lines, regressions = compare(new, ref, noise_band=True, metrics=("tokens_per_s", "step_ms"))
    assert regressions == 2 + 1 and "| a | tokens_per_s | 1000 | 950 | -5.0% | 2.0% | REGRESSION |" in "\n".join(lines)
    # a missing experiment is a regression; a reference sharing nothing is a usage error
    _, regressions = compare(_write(tmp_path / "part.csv", [row("a")]), ref)
    assert regressions == 2
    with pytest.raises(ValueError, match="share no experiment"):
        compare(_write(tmp_path / "other.csv", [row("z")]), ref)
    with pytest.raises(ValueError, match="unknown metric 'tokens'"):
        compare(new, ref, metrics=("tokens",))
    assert read_csv(ref)[0]["experiment"] == "a"


REFERENCE = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_h200_reference_guards_regressions(tmp_path):
    """The committed H200 reference of the headline scenario covers every experiment of the bundled file; its
    rerun (same machine, same session) passes against it; a 12% slower foak row or 12% more memory fails."""
    ref = REFERENCE / "bench_headline_h200" / "results.csv"
    rows = read_csv(ref)
    assert {r["experiment"] for r in rows} == {e["experiment"] for e in expand(load_scenario("headline"))}
    assert all(r["status"] == "ok" for r in rows)
    rerun = str(REFERENCE / "bench_headline_h200_rerun" / "results.csv")
    assert cli_main(["bench", "compare", rerun, str(ref)]) == 0
    doctored = read_csv(rerun)
    for r in doctored:
        if r["experiment"] == "llama8b-8l/b2xs4096/bf16/foak":
            r["tokens_per_s"] = float(r["tokens_per_s"]) * 0.88
        if r["experiment"] == "llama1b/b4xs4096/bf16/foak":
            r["peak_allocated_gib"] = float(r["peak_allocated_gib"]) * 1.12
    _, regressions = compare(_write(tmp_path / "slow.csv", doctored), str(ref))
    assert regressions == 2


def test_unavailable_framework_is_a_skipped_row(tmp_path):
    """A framework whose required module is missing runs nothing and is recorded as skipped."""
    from foak.bench.runner import run_scenario

    scenario = parse_scenario({"name": "skip", "frameworks": [
        {"name": "peer", "kind": "python", "callable": "no_such_peer_foak_test:apply",
         "requires": ["no_such_peer_foak_test"]}], "sweeps": [{"model": "tiny"}]})
    lines = []
    done = run_scenario(scenario, tmp_path, echo=lines.append)
    (row,) = done["results"]
    assert row["status"] == "skipped" and "no_such_peer_foak_test is not installed" in row["error"]
    assert not (tmp_path / "logs").exists()  # no process was started
    assert _rows(tmp_path / "results.csv")[0]["status"] == "skipped"


def test_skip_reasons(monkeypatch):
    from foak.bench import runner

    exp = {e["framework"]: e for e in expand(load_scenario("headline"))[:3]}
    monkeypatch.setattr(runner, "_gpu_count", lambda: 0)
    assert runner.skip_reason(exp["foak"], load_scenario("headline").framework("foak")) == \
        "device cuda: no CUDA GPU here"
    monkeypatch.setattr(runner, "_gpu_count", lambda: 1)
    assert runner.skip_reason(exp["foak"], load_scenario("headline").framework("foak")) is None
    assert runner.skip_reason({**exp["foak"], "gpus": 2}, load_scenario("headline").framework("foak")) == \
        "needs 2 GPUs, 1 here"


def test_resume_keeps_the_ok_rows(tmp_path):
    """--resume: an experiment with an ok row in the earlier results.json is not run again."""
    from foak.bench.runner import run_scenario

    scenario = parse_scenario({"name": "r", "frameworks": [
        "none", {"name": "peer", "kind": "python", "callable": "no_such_peer_foak_test:apply",
                 "requires": ["no_such_peer_foak_test"]}], "sweeps": [{"model": "tiny", "device": "cpu"}]})
    first, second = (e["experiment"] for e in expand(scenario))
    earlier = {"experiment": first, "point": first.rsplit("/", 1)[0], "framework": "none", "status": "ok",
               "tokens_per_s": 1234.0, "step_ms": 50.0, "peak_rss_gib": 0.5, "losses": [5.7, 5.6]}
    (tmp_path / "results.json").write_text(json.dumps({"results": [earlier]}))
    lines = []
    rows = run_scenario(scenario, tmp_path, resume=True, echo=lines.append)["results"]
    assert [r["status"] for r in rows] == ["ok", "skipped"] and rows[0]["tokens_per_s"] == 1234.0
    assert any("kept from the earlier run" in line for line in lines)
    assert not (tmp_path / "logs").exists()
    assert [r["experiment"] for r in _rows(tmp_path / "results.csv")] == [first, second]


FAKE_SMI = """#!/bin/sh
# a stand-in for nvidia-smi: the query mode foak uses (-lms: a line per sample until killed) and one-shot queries
case "$*" in
  *-lms=*) for used in 1000 1500 1250; do echo "$used, 40"; sleep 0.05; done; exec sleep 30 ;;
  *name,driver_version,memory.total*) echo "NVIDIA H200, 580.65, 143771" ;;
  *) echo "7, 8" ;;
esac
"""


def test_nvidia_smi_readers(tmp_path, monkeypatch):
    from foak.bench.measure import SmiSampler, nvidia_smi

    assert SmiSampler("cpu").index is None  # no CUDA device: nothing sampled
    exe = tmp_path / "nvidia-smi"
    exe.write_text(FAKE_SMI)
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    assert nvidia_smi("name", "driver_version", "memory.total") == [["NVIDIA H200", "580.65", "143771"]]
    sampler = SmiSampler("cpu", interval_ms=100)
    sampler.index, sampler.exe = 0, str(exe)  # as for a CUDA device
    with sampler:
        __import__("time").sleep(0.5)
    assert sampler.peak_used_mib == 1500 and sampler.mean_utilization == 40
    assert sampler._proc.poll() is not None  # the sampling process is gone


def test_every_builtin_model_is_an_architecture_foak_serves():
    """The built-in benchmark shapes build (on the meta device: no memory) as the architecture foak has rules
    for, and the architecture scenario runs each of them with HF, Liger and foak."""
    from foak.bench.models import BUILTIN_MODELS
    from foak.models import ARCHITECTURES

    for name, builtin in BUILTIN_MODELS.items():
        config = builtin.config()
        assert config.model_type in ARCHITECTURES, (name, config.model_type)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        assert model.config.model_type == config.model_type
    ids = [e["experiment"] for e in expand(load_scenario("archs"))]
    models = {i.split("/")[0] for i in ids}
    assert models == {"mistral7b-8l-swa", "gemma3-1b", "phi3-mini-8l", "gptoss-8l", "qwen35-8l"}
    assert len(ids) == 3 * len(models)


def test_longest_context_table_per_framework():
    """The summary of a scenario that sweeps seq_length names each framework's longest length that ran and the
    first that did not; the bundled long-context scenario sweeps 9 lengths for 4 frameworks (foak with the switches
    of --long_context among them)."""
    from foak.bench.report import longest_context_table

    def row(fw, n, status, mem=None):
        return {"model": "llama8b", "framework": fw, "peft": "lora", "batch_size": "1", "precision": "bf16",
                "packing": "False", "gradient_checkpointing": "True", "seq_length": str(n), "status": status,
                "peak_allocated_gib": mem, "tokens_per_s": 2000.0 if status == "ok" else None}

    rows = [row("liger", 65536, "ok", 40.0), row("liger", 131072, "ok", 81.8), row("liger", 196608, "oom"),
            row("foak", 65536, "ok", 35.0), row("foak", 131072, "ok", 70.0), row("foak", 196608, "ok", 100.0),
            row("none", 65536, "oom"), row("none", 131072, "oom")]
    table = longest_context_table(rows)
    assert "| llama8b | liger | 131,072 | 81.8 | 2,000 | 196,608 (oom) |" in table
    assert "| llama8b | foak | 196,608 | 100.0 | 2,000 | - |" in table
    assert "| llama8b | none | 0 |  |  | 65,536 (oom) |" in table
    assert longest_context_table(rows[:1]) == ""  # one length: no table
    ids = [e["experiment"] for e in expand(load_scenario("long-context"))]
    assert len(ids) == 36 and len({i.split("/")[2] for i in ids}) == 9  # 4 frameworks x 9 lengths
    long = load_scenario("long-context").framework("foak-long")
    assert long.switches["offload_activations"] and long.switches["tiled_mlp"]


def test_kernel_times_sums_self_time_per_name_largest_first():
    import torch

    from foak.bench.measure import kernel_times

    a = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            a @ a
        a + a
    rows = kernel_times(prof, top=5, cpu=True)
    assert rows[0]["name"] == "(total)" and len(rows) <= 6
    assert [r["ms"] for r in rows[1:]] == sorted((r["ms"] for r in rows[1:]), reverse=True)
    mm = next(r for r in rows if r["name"] == "aten::mm")
    assert mm["calls"] == 3 and rows[0]["ms"] >= sum(r["ms"] for r in rows[1:]) - 1e-9
    assert kernel_times(prof) == [{"name": "(total)", "calls": 0, "ms": 0}]  # no device kernels on the CPU


def test_gemm_shapes_and_layouts_count_each_product_by_shape_and_layout():
    import torch

    from foak.bench.measure import GemmLayouts, gemm_shapes

    a, b = torch.randn(6, 4), torch.randn(4, 5)
    bt = torch.randn(5, 4).t()  # the same shape as b, transposed layout
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        with GemmLayouts() as layouts:
            a @ b
            a @ b
            a @ bt
            torch.addmm(torch.zeros(6, 5), a, b)
            a + 1
    rows = gemm_shapes(prof)
    # counted once each although the dispatch mode dispatches every product again; one row per layout where the
    # profiler records strides (the transposed operand's call on a row of its own)
    assert sum(r["calls"] for r in rows if r["name"] == "aten::mm") == 3
    assert [r["calls"] for r in rows if r["name"] == "aten::addmm"] == [1]
    assert all(r["shapes"][:2] == [[6, 4], [4, 5]] for r in rows if r["name"] == "aten::mm")
    assert all(r["ms"] == 0 for r in rows)  # no device time on the CPU
    counted = {(r["name"], r["strides"]): r["calls"] for r in layouts.rows()}
    assert counted == {("aten.mm", "[[4, 1], [5, 1]]"): 2, ("aten.mm", "[[4, 1], [1, 4]]"): 1,
                       ("aten.addmm", "[[5, 1], [4, 1], [5, 1]]"): 1}
    assert all(set(r["aligned"]) <= {"a", "u"} for r in layouts.rows())


def test_gpu_tag_names_result_files_by_card():
    from foak.bench.measure import gpu_tag

    assert gpu_tag("NVIDIA H100 80GB HBM3") == "h100" and gpu_tag("NVIDIA H200") == "h200"
    assert gpu_tag("NVIDIA A100-SXM4-80GB") == "a100" and gpu_tag("NVIDIA L4") == "gpu"
    assert gpu_tag(None) == "cpu" and gpu_tag("cpu") == "cpu"
