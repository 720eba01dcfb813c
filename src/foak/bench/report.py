"""``foak bench`` results: the CSV (a row per experiment) and JSON, the plots, the markdown table, and
``foak bench compare`` (regressions of a new CSV against a reference CSV)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

# the CSV's columns, in order: the experiment's arguments, then its status and measurements
ARG_COLUMNS = ["experiment", "point", "scenario", "model", "framework", "peft", "batch_size", "seq_length",
               "precision", "packing", "gradient_checkpointing", "gpus", "warmup_steps", "timed_steps", "seed"]
METRIC_COLUMNS = ["status", "error", "tokens_per_s", "step_ms", "step_ms_median", "tokens_per_s_noise",
                  "step_ms_noise", "peak_allocated_gib", "peak_reserved_gib", "peak_rss_gib", "smi_peak_used_mib",
                  "smi_mean_utilization", "first_step_s", "setup_s", "first_loss", "final_loss", "tokens_per_step",
                  "trainable_params", "total_params", "repeats", "wall_s", "device_name"]
COLUMNS = ARG_COLUMNS + METRIC_COLUMNS
# compare: metric -> +1 higher is better, -1 lower is better; the noise column that widens its threshold
METRICS = {"tokens_per_s": (+1, "tokens_per_s_noise"), "step_ms": (-1, "step_ms_noise"),
           "peak_allocated_gib": (-1, None), "peak_reserved_gib": (-1, None), "peak_rss_gib": (-1, None),
           "smi_peak_used_mib": (-1, None), "first_step_s": (-1, None), "final_loss": (-1, None)}
DEFAULT_METRICS = ("tokens_per_s", "step_ms", "peak_allocated_gib", "peak_reserved_gib", "final_loss")


def _cell(value):
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(row.get(k)) for k in COLUMNS})


def read_csv(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such results file: {str(path)!r}")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "experiment" not in reader.fieldnames:
            raise ValueError(f"{str(path)!r} is not a foak bench results CSV (no 'experiment' column)")
        return list(reader)


def write_json(data: dict, path: Path) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


def _num(value) -> float | None:
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


# ---- tables and plots ----------------------------------------------------------------------------------------
def _groups(rows: list[dict]) -> tuple[list[str], list[str]]:
    points, frameworks = [], []
    for r in rows:
        if r["point"] not in points:
            points.append(r["point"])
        if r["framework"] not in frameworks:
            frameworks.append(r["framework"])
    return points, frameworks


def _memory(row: dict) -> tuple[float | None, str]:
    value = _num(row.get("peak_allocated_gib"))
    if value is not None:
        return value, "peak GiB allocated (torch)"
    return _num(row.get("peak_rss_gib")), "peak GiB (process max RSS, CPU)"


def markdown_table(rows: list[dict], baseline: str | None) -> str:
    """One line per point (the experiment without its framework), a column per framework with tokens/s · peak
    GiB, then each framework's ratio to the baseline."""
    points, frameworks = _groups(rows)
    by = {(r["point"], r["framework"]): r for r in rows}
    others = [f for f in frameworks if f != baseline] if baseline else []
    head = ["experiment"] + [f"{f} tokens/s · peak GiB" for f in frameworks]
    head += [f"{f} vs {baseline}" for f in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for point in points:
        cells = [point]
        for fw in frameworks:
            r = by.get((point, fw))
            if r is None:
                cells.append("")
            elif r.get("status") != "ok":
                error = str(r.get("error") or "")[:60].replace("|", "/")
                cells.append(f"{r.get('status')}: {error}" if error else str(r.get("status")))
            else:
                tps, (mem, _) = _num(r.get("tokens_per_s")), _memory(r)
                cells.append(f"{tps:,.0f} · {mem:.2f}" if tps is not None and mem is not None else f"{tps:,.0f}")
        base = by.get((point, baseline))
        for fw in others:
            r = by.get((point, fw))
            ok = r is not None and base is not None and r.get("status") == "ok" and base.get("status") == "ok"
            if ok and _num(base.get("tokens_per_s")):
                speed = _num(r["tokens_per_s"]) / _num(base["tokens_per_s"])
                mem_new, mem_base = _memory(r)[0], _memory(base)[0]
                memory = f", {100 * (mem_new / mem_base - 1):+.0f}% memory" if mem_new and mem_base else ""
                cells.append(f"{speed:.2f}x{memory}")
            else:
                cells.append("")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_CONTEXT_KEY = ("model", "framework", "peft", "batch_size", "precision", "packing", "gradient_checkpointing")


def longest_context_table(rows: list[dict]) -> str:
    """Where a scenario sweeps seq_length (e.g. the bundled long-context one): per model and framework (the
    other training arguments equal), the longest sequence that ran, its peak memory, and the shortest one
    that did not (its status: oom, timeout...). Empty when no group has more than one length."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(str(r.get(k)) for k in _CONTEXT_KEY), []).append(r)
    lines = []
    for key, group in groups.items():
        lengths = {int(_num(r.get("seq_length")) or 0) for r in group}
        if len(lengths) < 2:
            continue
        ok = [r for r in group if r.get("status") == "ok"]
        best = max(ok, key=lambda r: int(_num(r["seq_length"]))) if ok else None
        longest = int(_num(best["seq_length"])) if best else 0
        failed = sorted((r for r in group if r.get("status") != "ok" and int(_num(r.get("seq_length")) or 0) > longest),
                        key=lambda r: int(_num(r["seq_length"])))
        first_fail = f"{int(_num(failed[0]['seq_length'])):,} ({failed[0].get('status')})" if failed else "-"
        mem = f"{_memory(best)[0]:.1f}" if best and _memory(best)[0] is not None else ""
        tps = f"{_num(best.get('tokens_per_s')):,.0f}" if best and _num(best.get("tokens_per_s")) else ""
        lines.append(f"| {key[0]} | {key[1]} | {longest:,} | {mem} | {tps} | {first_fail} |")
    if not lines:
        return ""
    head = ("| model | framework | longest sequence that ran | its peak GiB | its tokens/s | first that did not |\n"
            "|---|---|---|---|---|---|\n")
    return "\n## Longest context\n\n" + head + "\n".join(lines) + "\n"


def _short(point: str) -> str:
    return point.replace("/", "\n", 1) if len(point) > 24 else point


def plot_bars(rows: list[dict], baseline: str | None, path: Path, what: str, title: str) -> None:
    """Grouped bars, one group per point and one bar per framework (the baseline first, hatched), labelled
    with the ratio to the baseline. ``what``: "throughput" (tokens/s) or "memory" (peak GiB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points, frameworks = _groups(rows)
    if baseline in frameworks:
        frameworks = [baseline] + [f for f in frameworks if f != baseline]
    by = {(r["point"], r["framework"]): r for r in rows}

    def value(r):
        if r is None or r.get("status") != "ok":
            return None
        return _num(r.get("tokens_per_s")) if what == "throughput" else _memory(r)[0]

    ylabel = "tokens/s" if what == "throughput" else next(
        (_memory(r)[1] for r in rows if r.get("status") == "ok"), "peak GiB")
    width = 0.8 / max(len(frameworks), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(points) * max(len(frameworks), 2) / 2), 4.5))
    for i, fw in enumerate(frameworks):
        xs, ys, labels = [], [], []
        for j, point in enumerate(points):
            v = value(by.get((point, fw)))
            if v is None:
                r = by.get((point, fw))
                if r is not None:  # a failed / skipped experiment: say so where its bar would be
                    ax.text(j + (i - (len(frameworks) - 1) / 2) * width, 0, str(r.get("status")), rotation=90,
                            ha="center", va="bottom", fontsize=7, color="crimson")
                continue
            base = value(by.get((point, baseline))) if baseline else None
            xs.append(j + (i - (len(frameworks) - 1) / 2) * width)
            ys.append(v)
            labels.append(f"{v / base:.2f}x" if base and fw != baseline else "")
        bars = ax.bar(xs, ys, width * 0.95, label=fw + (" (baseline)" if fw == baseline else ""), color=f"C{i % 10}",
                      hatch="//" if fw == baseline else None, edgecolor="black", linewidth=0.4)
        for bar, text in zip(bars, labels):
            if text:
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center", va="bottom",
                        fontsize=7)
    ax.set_xticks(range(len(points)))
    ax.set_xticklabels([_short(p) for p in points], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.18)  # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper left", ncol=max(len(frameworks), 1))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_losses(results: list[dict], path: Path, title: str) -> None:
    """The per-step losses of every ok experiment, one panel per point, a line per framework."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.get("status") == "ok" and r.get("losses")]
    points, frameworks = _groups(results)
    colors = {fw: f"C{i % 10}" for i, fw in enumerate(frameworks)}  # one color per framework in every panel
    points = [p for p in points if any(r["point"] == p for r in ok)] or points[:1]
    cols = min(3, len(points))
    rows_n = math.ceil(len(points) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.0 * rows_n), squeeze=False)
    for ax, point in zip(axes.flat, points):
        for r in ok:
            if r["point"] == point:
                ax.plot(range(1, len(r["losses"]) + 1), r["losses"], marker="o", markersize=2.5, label=r["framework"],
                        color=colors[r["framework"]])
        ax.set_title(point, fontsize=7)
        ax.set_xlabel("step", fontsize=7)
        ax.set_ylabel("loss", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(points):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: list[dict], env: dict, scenario_info: dict, out: Path) -> dict:
    """results.csv, results.json, summary.md, throughput.png, memory.png, loss.png in ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    baseline = scenario_info.get("baseline")
    paths = {"csv": out / "results.csv", "json": out / "results.json", "markdown": out / "summary.md",
             "throughput": out / "throughput.png", "memory": out / "memory.png", "loss": out / "loss.png"}
    write_csv(results, paths["csv"])
    write_json({"scenario": scenario_info, "environment": env, "results": results}, paths["json"])
    commit = env.get("foak_commit")
    commit = (commit[:10] + ("-dirty" if commit.endswith("-dirty") else "")) if commit else "no git"
    where = f"{env.get('gpu')}, torch {env.get('torch')}, foak {env.get('foak')} ({commit})"
    table = markdown_table(results, baseline) + longest_context_table(results)
    paths["markdown"].write_text(f"# foak bench: {scenario_info.get('name')}\n\n{scenario_info.get('description', '')}"
                                 f"\n\n{where}; {env.get('date_utc')}\n\n{table}")
    title = f"{scenario_info.get('name')}: {where}"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("foak bench: matplotlib is not installed, so no plots (pip install matplotlib, then foak bench report "
              f"{out})", flush=True)
        return {k: v for k, v in paths.items() if k in ("csv", "json", "markdown")}
    plot_bars(results, baseline, paths["throughput"], "throughput", title)
    plot_bars(results, baseline, paths["memory"], "memory", title)
    plot_losses(results, paths["loss"], title)
    return paths


def rewrite_report(out: str | Path) -> dict:
    """The CSV, summary and plots again from ``out``/results.json (e.g. made where matplotlib was missing)."""
    out = Path(out)
    path = out / "results.json"
    if not path.is_file():
        raise ValueError(f"no {path}: give the --out directory of a foak bench run")
    try:
        data = json.loads(path.read_text())
        results, env, info = data["results"], data["environment"], data["scenario"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path} is not a foak bench results file") from None
    return write_report(results, env, info, out)


# ---- compare ----------------------------------------------------------------------------------------------
def compare(new_path, ref_path, threshold: float = 0.10, metrics=DEFAULT_METRICS, noise_band: bool = False):
    """(lines of the comparison table, number of regressions). Rows are matched by their experiment; a metric
    regresses when it is worse than the reference's by more than ``threshold`` (a fraction), or, with
    ``noise_band``, by more than the reference row's recorded noise band for that metric (its threshold when
    it recorded none). An experiment that was ok in the reference and is not ok (or missing) now regresses."""
    if not 0 < threshold < 10:
        raise ValueError(f"--threshold must be a fraction such as 0.1 (10%), got {threshold}")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric {unknown[0]!r}; metrics: {', '.join(METRICS)}")
    new = {r["experiment"]: r for r in read_csv(new_path)}
    ref = {r["experiment"]: r for r in read_csv(ref_path)}
    common = [k for k in ref if k in new]
    if not common:
        raise ValueError(f"{new_path} and {ref_path} share no experiment (rows are matched by the 'experiment' "
                         "column)")
    lines = ["| experiment | metric | reference | new | change | allowed | verdict |", "|---|---|---|---|---|---|---|"]
    regressions = 0
    for key in ref:
        r_ref = ref[key]
        r_new = new.get(key)
        if r_ref.get("status") != "ok":
            continue
        if r_new is None or r_new.get("status") != "ok":
            why = "missing from the new results" if r_new is None else f"{r_new.get('status')}: {r_new.get('error')}"
            lines.append(f"| {key} | status | ok | {why[:80]} | | | REGRESSION |")
            regressions += 1
            continue
        for metric in metrics:
            sign, noise_col = METRICS[metric]
            a, b = _num(r_ref.get(metric)), _num(r_new.get(metric))
            if a is None or b is None or a == 0:
                continue
            allowed = threshold
            if noise_band and noise_col:
                band = _num(r_ref.get(noise_col))
                allowed = band if band else threshold
            change = (b - a) / abs(a)
            worse = -change * sign  # > 0: worse
            verdict = "REGRESSION" if worse > allowed else ("better" if worse < -allowed else "ok")
            regressions += verdict == "REGRESSION"
            lines.append(f"| {key} | {metric} | {a:.6g} | {b:.6g} | {100 * change:+.1f}% | {100 * allowed:.1f}% | "
                         f"{verdict} |")
    for key in new:
        if key not in ref:
            lines.append(f"| {key} | | (not in the reference) | {new[key].get('status')} | | | new |")
    return lines, regressions
