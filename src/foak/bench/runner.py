"""Runs a scenario's experiments, each in its own process (``python -m foak.bench.worker``; through
``torchrun`` when it asks for several GPUs), one after the other, and writes the results.

A failed experiment is a result row (status failed / oom / killed / timeout, with the reason and its log),
then the next one runs. An experiment whose framework is not installed, or that needs more GPUs than there
are, is a "skipped" row. results.csv and results.json are rewritten after every experiment, so an
interrupted run keeps what it measured; the plots and summary.md come at the end."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from foak.bench.report import write_csv, write_json, write_report
from foak.bench.scenario import Scenario, expand, framework_unavailable

SIGNAL_HINTS = {signal.SIGKILL: "killed (SIGKILL: the kernel's OOM killer sends it when the host runs out of memory)",
                signal.SIGSEGV: "crashed (SIGSEGV)", signal.SIGABRT: "aborted (SIGABRT)",
                signal.SIGBUS: "crashed (SIGBUS)"}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text)[:120]


def _child_env(exp: dict) -> dict:
    env = {**os.environ, **(exp.get("env") or {})}
    src = str(Path(__file__).resolve().parents[2])  # the directory holding this foak package: the same foak runs
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def command(exp: dict, exp_path: Path, result_path: Path) -> list[str]:
    worker = ["-m", "foak.bench.worker", str(exp_path), str(result_path)]
    if exp["gpus"] > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={exp['gpus']}",
                *worker]
    return [sys.executable, *worker]


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skip_reason(exp: dict, fw) -> str | None:
    missing = framework_unavailable(fw)
    if missing:
        return missing
    if exp["device"] != "cpu":
        gpus = _gpu_count()
        if exp["device"] == "cuda" and gpus == 0:
            return "device cuda: no CUDA GPU here"
        if gpus and exp["gpus"] > gpus:
            return f"needs {exp['gpus']} GPUs, {gpus} here"
    return None


def _log_tail(path: Path, n: int = 3) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def run_one(exp: dict, workdir: Path, index: int) -> dict:
    """Run one experiment in its own process; its result dict (never raises for the experiment's failure)."""
    stem = f"{index:03d}_{_slug(exp['experiment'])}"
    exp_path, result_path, log_path = (workdir / "experiments" / f"{stem}.json", workdir / "experiments" /
                                       f"{stem}.result.json", workdir / "logs" / f"{stem}.log")
    exp_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    exp_path.write_text(json.dumps(exp, indent=1))
    result_path.unlink(missing_ok=True)
    cmd = command(exp, exp_path, result_path)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(exp),
                                start_new_session=True)  # its own process group: a timeout ends all of it
        timed_out = False
        try:
            rc = proc.wait(timeout=exp["timeout_s"])
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        except BaseException:  # Ctrl-C: end the experiment too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    wall = time.perf_counter() - start
    result = None
    if result_path.is_file():
        try:
            result = json.loads(result_path.read_text())
        except ValueError:
            result = None
    if result is None:
        tail = _log_tail(log_path)
        if timed_out:
            result = {"status": "timeout", "error": f"no result within timeout_s={exp['timeout_s']} (killed)"}
        elif rc < 0:
            sig = signal.Signals(-rc)
            result = {"status": "killed", "error": SIGNAL_HINTS.get(sig, f"killed by {sig.name}") + f"; log: {tail}"}
        else:
            oom = "out of memory" in tail.lower() or "outofmemory" in tail.lower()
            result = {"status": "oom" if oom else "failed", "error": f"exit code {rc}, no result; log: {tail}"}
    result["wall_s"] = wall
    result["log"] = str(log_path)
    result["command"] = " ".join(cmd)
    return result


def _aggregate(runs: list[dict]) -> dict:
    """Repeats of one experiment: the median tokens/s run's row; noise bands from the spread across the runs;
    the largest peaks. A repeat that failed makes the experiment failed."""
    bad = next((r for r in runs if r.get("status") != "ok"), None)
    if bad is not None or len(runs) == 1:
        return {**(bad or runs[0]), "repeats": len(runs)}
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    row = dict(ordered[len(ordered) // 2])
    from foak.bench.measure import relative_spread

    row["tokens_per_s_noise"] = relative_spread([r["tokens_per_s"] for r in runs])
    row["step_ms_noise"] = relative_spread([r["step_ms"] for r in runs])
    for key in ("peak_allocated_gib", "peak_reserved_gib", "peak_rss_gib", "smi_peak_used_mib"):
        values = [r[key] for r in runs if r.get(key) is not None]
        row[key] = max(values) if values else None
    row["wall_s"] = sum(r["wall_s"] for r in runs)
    row["repeats"] = len(runs)
    row["repeat_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    return row


def _fmt_result(r: dict) -> str:
    if r.get("status") != "ok":
        return f"{r.get('status')}: {r.get('error')}"
    mem = r.get("peak_allocated_gib")
    mem_text = f"peak {mem:.2f} GiB" if mem is not None else f"max RSS {r.get('peak_rss_gib', math.nan):.2f} GiB"
    return (f"ok: {r['tokens_per_s']:,.0f} tokens/s, step {r['step_ms']:.1f} ms, {mem_text}, first step "
            f"{r['first_step_s']:.1f} s, loss {r['first_loss']:.4f} -> {r['final_loss']:.4f}")


def _print(line: str) -> None:
    print(line, flush=True)


def _on_sigterm(signum, frame):
    # SystemExit passes run_one's handler, which ends the experiment's process group, then exits (128 + 15)
    print(f"foak bench: terminated (signal {signum}); results.csv and results.json hold the finished experiments",
          flush=True)
    raise SystemExit(128 + signum)


def _previous_rows(out: Path) -> dict:
    path = out / "results.json"
    if not path.is_file():
        return {}
    try:
        rows = json.loads(path.read_text()).get("results", [])
    except ValueError:
        raise ValueError(f"--resume: {path} is not a foak bench results file") from None
    return {r["experiment"]: r for r in rows if r.get("status") == "ok"}


def run_scenario(scenario: Scenario, out: str | Path, only: str | None = None, dry_run: bool = False,
                 timeout_s: float | None = None, resume: bool = False, echo=_print) -> dict:
    """Run every experiment of ``scenario`` (those whose id matches the regular expression ``only``), write
    results.csv, results.json, summary.md and the plots to ``out``. Returns {"results": rows, "paths": ...}.
    ``resume``: keep the ok rows of an earlier run into ``out`` and run only the other experiments. SIGTERM
    (e.g. ``timeout``) ends the running experiment's processes too, and keeps the files written so far."""
    from foak.bench.measure import environment

    experiments = expand(scenario)
    if only:
        try:
            pattern = re.compile(only)
        except re.error as e:
            raise ValueError(f"--only {only!r} is not a regular expression: {e}") from None
        experiments = [e for e in experiments if pattern.search(e["experiment"])]
        if not experiments:
            raise ValueError(f"--only {only!r} matches no experiment of scenario {scenario.name!r}")
    if timeout_s is not None:
        for e in experiments:
            e["timeout_s"] = timeout_s
    if dry_run:
        for i, e in enumerate(experiments, 1):
            echo(f"[{i}/{len(experiments)}] {e['experiment']}")
        return {"results": [], "paths": {}, "experiments": experiments}
    out = Path(out)
    previous = _previous_rows(out) if resume else {}
    out.mkdir(parents=True, exist_ok=True)
    env = environment(init_cuda=False)
    info = {"name": scenario.name, "description": scenario.description, "source": scenario.source,
            "baseline": scenario.baseline_name, "repeats": scenario.repeats}
    echo(f"foak bench {scenario.name}: {len(experiments)} experiments x {scenario.repeats} run(s), each in its own "
         f"process; {env['gpu']}, torch {env['torch']}, foak {env['foak']} ({env.get('foak_commit')}); results in "
         f"{out}")
    results = []
    total_start = time.perf_counter()
    try:
        old_handler = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: no handler
        old_handler = None
    try:
        _run_all(scenario, experiments, previous, out, env, info, results, echo)
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
    if any(r.get("status") == "ok" for r in results):
        devices = {r.get("device_name") for r in results if r.get("status") == "ok"}
        if env.get("gpu") in ("cuda", None) and devices:
            env["gpu"] = ", ".join(sorted(d for d in devices if d))
    paths = write_report(results, env, info, out)
    counts = {s: sum(r.get("status") == s for r in results) for s in dict.fromkeys(r.get("status") for r in results)}
    echo(f"foak bench {scenario.name}: " + ", ".join(f"{n} {s}" for s, n in counts.items())
         + f" in {time.perf_counter() - total_start:.0f} s; " + ", ".join(str(p) for p in paths.values()))
    return {"results": results, "paths": paths, "experiments": experiments}


def _run_all(scenario, experiments, previous, out, env, info, results, echo) -> None:
    """Each experiment in turn (kept from ``previous`` when there), results.csv/json rewritten after each."""
    for i, exp in enumerate(experiments, 1):
        if exp["experiment"] in previous:
            results.append(previous[exp["experiment"]])
            echo(f"[{i}/{len(experiments)}] {exp['experiment']}: kept from the earlier run in {out} (--resume)")
            continue
        echo(f"[{i}/{len(experiments)}] {exp['experiment']}")
        why = skip_reason(exp, scenario.framework(exp["framework"]))
        if why:
            result = {"status": "skipped", "error": why, "repeats": 0, "wall_s": 0.0}
        else:
            runs = []
            for repeat in range(scenario.repeats):
                runs.append(run_one(exp, out, i if scenario.repeats == 1 else i * 100 + repeat))
                if runs[-1].get("status") != "ok":
                    break
            result = _aggregate(runs)
        row = {k: v for k, v in exp.items() if k not in ("env",)}
        row.update(result)
        results.append(row)
        echo(f"    {_fmt_result(row)} ({row.get('wall_s', 0):.0f} s)")
        write_csv(results, out / "results.csv")
        write_json({"scenario": info, "environment": env, "results": results}, out / "results.json")
