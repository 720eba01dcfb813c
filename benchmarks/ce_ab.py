"""Same-run A/B of the cross-entropy kernel: this tree's foak.cross_entropy against another version of
ops/cross_entropy.py loaded from a file (e.g. the one before a change), fwd+bwd at ANCHORS' shape.

    python3 benchmarks/ce_ab.py OLD_FILE.py [MORE.py ...] [--out DIR]   # their custom ops renamed (no clash)

Timing: CUDA events around each call after a spin kernel (foak.bench.measure.spin_median_ms), passes
alternate A, B, A, B so that drift hits both; medians printed and written to DIR/ce_ab_h200.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch



def main() -> int:
    import foak
    from foak.bench.measure import environment
    from foak.bench.measure import spin_median_ms as cuda_median_ms

    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+", help="other versions of ops/cross_entropy.py")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    versions = {"this tree": foak.cross_entropy}
    for path in args.files:
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        versions[Path(path).stem] = module.cross_entropy
    torch.manual_seed(0)
    n, v = 8192, 128256
    logits = (torch.randn(n, v, device="cuda") * 2).bfloat16()
    target = torch.randint(0, v, (n,), device="cuda")
    target[::7] = -100
    leaf = logits.clone().requires_grad_()

    def call(fn):
        def run():
            leaf.grad = None
            fn(leaf, target, check_targets=False).backward()
        return run

    runs = {name: call(fn) for name, fn in versions.items()}
    grads = {}
    for name, run in runs.items():  # same numbers first
        run()
        grads[name] = leaf.grad.float().clone()
    ref = grads["this tree"]
    agree = {name: (g - ref).abs().max().item() for name, g in grads.items()}
    times = {name: [] for name in runs}
    for _ in range(3):
        for name, run in runs.items():
            times[name].append(cuda_median_ms(run, reps=args.reps))
    result = {"shape": [n, v], "dtype": "bfloat16", "ignored": "1/7", "max_abs_grad_difference": agree,
              "ms_per_pass": times, "environment": environment()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "ce_ab_h200.json").write_text(json.dumps(result, indent=1))
    print(f"max |grad - this tree's grad|: {agree}")
    print("| kernel | pass 1 | pass 2 | pass 3 | best |")
    print("|---|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | " + " | ".join(f"{x:.3f}" for x in t) + f" | {min(t):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
