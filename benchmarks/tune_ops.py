"""Sweep foak's launch knobs (ops' TUNING dicts) at the ANCHORS shapes on a GPU; prints the best per op.

Run on the H200: python3 benchmarks/tune_ops.py [--out DIR]. Times forward+backward (bf16), median of
CUDA-event timings with the host's launch overhead hidden (see foak.bench.measure.spin_median_ms); inputs are
fresh non-leaf clones each repetition, outside the timed region.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os

import torch

from foak.bench.measure import environment
from foak.bench.measure import spin_median_ms as cuda_median_ms  # host launch overhead hidden

import foak  # noqa: E402
from foak.ops.cross_entropy import cross_entropy  # noqa: E402
from foak.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402


def time_fwd_bwd(fn, leaves, reps=30, warmup=5):
    outs = fn(*[t.clone() for t in leaves])
    grads = [torch.randn_like(o) for o in (outs if isinstance(outs, tuple) else (outs,))]
    del outs
    # fresh non-leaf inputs each repetition, outside the timed region
    return cuda_median_ms(lambda ins: torch.autograd.grad(fn(*ins), ins, grads),
                          lambda: ([t.clone() for t in leaves],), warmup, reps)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--ops", nargs="*", help="sweep only these ops (default: all)")
    args = parser.parse_args()
    dev, bf16 = "cuda", torch.bfloat16

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=bf16, requires_grad=True)

    angles = torch.rand(4, 4096, 64, device=dev) * 6.3
    cos, sin = torch.cat((angles, angles), -1).cos().to(bf16), torch.cat((angles, angles), -1).sin().to(bf16)
    w = leaf(4096)
    head = torch.nn.Parameter(torch.randn(128256, 4096, device=dev, dtype=bf16) * 0.02)
    target = torch.randint(0, 128256, (8192,), device=dev)
    target[torch.randperm(8192, device=dev)[: 8192 // 7]] = -100  # 1/7 ignored, as in ANCHORS
    sweeps = {
        "rms_norm": (
            "foak.ops.rms_norm",
            {"forward_warps": [4, 8, 16], "backward_warps": [4, 8, 16], "backward_programs_per_sm": [1, 2, 4, 8]},
            lambda x: foak.rms_norm(x, w),
            [leaf(16384, 4096)],
        ),
        "rope": (
            "foak.ops.rope",
            {"warps": [2, 4, 8, 16]},
            lambda q, k: foak.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin),
            [leaf(4, 4096, 32, 128), leaf(4, 4096, 8, 128)],
        ),
        "swiglu": (
            "foak.ops.activations",
            {"block": [1024, 2048, 4096, 8192], "warps": [4, 8, 16], "eviction": ["", "evict_first"]},
            lambda g, u: foak.swiglu(g, u),
            [leaf(16384, 14336), leaf(16384, 14336)],
        ),
        "cross_entropy": (
            "foak.ops.cross_entropy",
            {"block": [2048, 4096, 16384], "warps": [8, 16, 32], "programs_per_sm": [0]},
            lambda x: cross_entropy(x, target, check_targets=False),  # the kernels, without the host sync
            [leaf(8192, 128256)],
        ),
        "linear_cross_entropy": (
            "foak.ops.linear_cross_entropy",
            {"chunk_bytes": [mib * 2**20 for mib in (64, 96, 112, 128, 192)]},
            lambda h: linear_cross_entropy(h, head, target),
            [leaf(8192, 4096)],
        ),
    }
    sweeps = {k: v for k, v in sweeps.items() if not args.ops or k in args.ops}
    results = {}
    for op, (module_name, grid, fn, leaves) in sweeps.items():
        tuning = importlib.import_module(module_name).TUNING
        default = dict(tuning)
        rows = []
        for values in itertools.product(*grid.values()):
            tuning.update(dict(zip(grid, values)))
            rows.append({"config": dict(zip(grid, values)), "ms": time_fwd_bwd(fn, leaves)})
            print(op, rows[-1], flush=True)
        tuning.clear()
        tuning.update(default)
        rows.append({"config": "default", "ms": time_fwd_bwd(fn, leaves)})
        best = min(rows, key=lambda r: r["ms"])
        results[op] = {"rows": rows, "best": best}
        print(f"BEST {op}: {best} (default {rows[-1]['ms']:.4f} ms)", flush=True)
        del leaves
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    name = "tune_h200.json" if not args.ops else f"tune_h200_{'_'.join(args.ops)}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump({"environment": environment(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
