"""``foak bench``: ``foak bench SCENARIO [--out DIR] [--only REGEX] [--dry-run] [--resume]``,
``foak bench compare NEW.csv REF.csv [--threshold 0.1] [--noise-band] [--metrics ...]``, ``foak bench report DIR``
(the CSV, summary and plots again from DIR/results.json) and ``foak bench --list``.

Exit codes: 0 done (compare: no regression), 1 compare found a regression, 2 a usage error (foak's CLI prints
the ValueError as one line). A failed experiment does not fail ``foak bench``: it is a result row."""

from __future__ import annotations

import argparse

from foak.bench.report import DEFAULT_METRICS, METRICS

EXAMPLES = """\
examples:
  foak bench headline --out results/headline       # a bundled scenario: the README's full fine-tuning table
  foak bench my_scenarios.yaml --only llama1b --dry-run
  foak bench compare results/headline/results.csv benchmarks/results/bench_headline_h200/results.csv
  foak bench report results/headline               # the summary and plots again from its results.json"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def _run_parser() -> argparse.ArgumentParser:
    from foak.bench.scenario import bundled_scenarios

    parser = _Parser(prog="foak bench", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
                     description="Run a benchmark scenario: every experiment (model x framework x training "
                                 "arguments) in its own process; results.csv, results.json, summary.md and plots in "
                                 "--out. Bundled scenarios: " + ", ".join(bundled_scenarios()) + ".")
    parser.add_argument("scenario", nargs="?", help="a scenario YAML file or the name of a bundled scenario")
    parser.add_argument("--out", help="output directory (default: bench-results/<scenario name>)")
    parser.add_argument("--only", help="run only the experiments whose id matches this regular expression")
    parser.add_argument("--dry-run", action="store_true", help="list the experiments, run nothing")
    parser.add_argument("--resume", action="store_true",
                        help="keep the ok rows of an earlier run into --out, run the other experiments")
    parser.add_argument("--timeout", type=float, help="seconds per experiment (overrides the scenario's timeout_s)")
    parser.add_argument("--list", action="store_true", help="list the bundled scenarios")
    return parser


def _compare_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="foak bench compare",
                     description="Compare a results CSV with a reference one, experiment by experiment; exit code 1 "
                                 "when a metric is worse than the reference by more than the threshold (or a "
                                 "reference experiment that was ok failed or is missing), 0 otherwise.")
    parser.add_argument("new", help="results.csv of the run to check")
    parser.add_argument("reference", help="results.csv of the reference run")
    parser.add_argument("--threshold", type=float, default=0.10, help="allowed relative regression (default 0.10)")
    parser.add_argument("--noise-band", action="store_true",
                        help="allow each reference row's recorded noise band instead (tokens/s, step time), where "
                             "it recorded one")
    parser.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS), metavar="METRIC",
                        help=f"metrics to compare (default: {' '.join(DEFAULT_METRICS)}; any of {', '.join(METRICS)})")
    return parser


def main(argv: list[str]) -> int:
    if argv and argv[0] == "report":
        from foak.bench.report import rewrite_report

        if len(argv) != 2 or argv[1].startswith("-"):
            raise ValueError("usage: foak bench report OUT_DIR (the --out directory of a run, holding results.json)")
        paths = rewrite_report(argv[1])
        print("foak bench report: " + ", ".join(str(p) for p in paths.values()))
        return 0
    if argv and argv[0] == "compare":
        from foak.bench.report import compare

        try:
            args = _compare_parser().parse_args(argv[1:])
        except SystemExit as e:  # --help
            return e.code if isinstance(e.code, int) else 0
        lines, regressions = compare(args.new, args.reference, args.threshold, args.metrics, args.noise_band)
        print("\n".join(lines))
        print(f"foak bench compare: {regressions} regression(s) beyond "
              + ("the reference's noise band" if args.noise_band else f"{100 * args.threshold:.0f}%")
              + f" ({args.new} vs {args.reference})")
        return 1 if regressions else 0
    try:
        args = _run_parser().parse_args(argv)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    from foak.bench.scenario import bundled_scenarios, load_scenario

    if args.list:
        for name, path in bundled_scenarios().items():
            scenario = load_scenario(path)
            print(f"{name:10} {scenario.description}")
        return 0
    if not args.scenario:
        raise ValueError("give a scenario file or a bundled scenario name (foak bench --list), or compare NEW REF")
    from foak.bench.runner import run_scenario

    scenario = load_scenario(args.scenario)
    out = args.out or f"bench-results/{scenario.name}"
    run_scenario(scenario, out, only=args.only, dry_run=args.dry_run, timeout_s=args.timeout, resume=args.resume)
    return 0
