"""foak's MoE experts op (foak.ops.moe.moe_experts) on the H200 vs transformers' experts backends (issue [moe]).

    python benchmarks/moe.py            # CUDA: checks, then fwd+bwd timings; JSON in $OUT (default ./out)
    python benchmarks/moe.py --cpu-smoke   # CPU, Triton interpreter, tiny shapes: the checks only

Shapes (bf16, SwiGLU experts, routing = softmax -> top-k -> renormalise over random logits):
Mixtral-like T=8192 E=8 top-2 H=4096 I=14336, Qwen3-MoE-like T=16384 E=128 top-8 H=2048 I=768.
Variants: ``loop`` (transformers' eager MixtralExperts forward: a Python loop over experts), ``grouped_mm``
(transformers' grouped_mm experts backend: torch._grouped_mm), ``foak`` (moe_experts). Times: CUDA-event
median of --reps fwd+bwd calls (out.backward(dy): grads of hidden states, routing weights, both weight
tensors) after 2 warm-up calls; ``first_s``: wall time of the very first call (compilation, autotuning);
``extra_MiB``: peak allocated during a call minus what was allocated before it; TFLOP/s counts the six
expert GEMMs (18 * T * k * H * I FLOPs). Checks: foak vs grouped_mm in bf16 at both shapes (relative max
error of the output and of each gradient <= 2e-2), and at a medium shape with two experts left without
tokens: fp32 foak (per-expert mm) vs the eager loop <= 1e-5, and bf16 foak (grouped_mm path) with exactly
zero weight gradients for the empty experts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_world import timed_ms  # noqa: E402

SHAPES = {"mixtral": dict(T=8192, E=8, k=2, H=4096, I=14336), "qwen3_moe": dict(T=16384, E=128, k=8, H=2048, I=768)}
MEDIUM = dict(T=1024, E=8, k=2, H=1024, I=2048)
SMOKE_SHAPES = {"tiny": dict(T=37, E=4, k=2, H=48, I=80)}


def build(shape, dtype, device, empty=()):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=shape["H"], intermediate_size=shape["I"], num_local_experts=shape["E"],
                        num_experts_per_tok=shape["k"])
    module = MixtralExperts(cfg).to(device=device, dtype=dtype)
    torch.manual_seed(0)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.02)
        module.down_proj.normal_(0, 0.02)
    x = torch.randn(shape["T"], shape["H"], device=device, dtype=dtype)
    logits = torch.randn(shape["T"], shape["E"], device=device)
    if empty:
        logits[:, list(empty)] = -float("inf")
    w, idx = torch.topk(logits.softmax(-1), shape["k"], dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    dy = torch.randn_like(x)
    return module, x, idx, w, dy


def variant_fn(name, module):
    from foak.ops.moe import moe_experts

    if name == "foak":
        return lambda x, idx, w: moe_experts(x, idx, w, module.gate_up_proj, module.down_proj)
    module.config._experts_implementation = "eager" if name == "loop" else name
    return lambda x, idx, w: module(x, idx, w)


def fwd_bwd(fn, module, x, idx, w, dy):
    xr = x.detach().requires_grad_()
    wr = w.detach().requires_grad_()
    module.gate_up_proj.grad = module.down_proj.grad = None
    out = fn(xr, idx, wr)
    out.backward(dy)
    return out.detach(), xr.grad, wr.grad, module.gate_up_proj.grad, module.down_proj.grad


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--variants", default="loop,grouped_mm,foak")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    if SMOKE:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import triton_interpreter_compat

        triton_interpreter_compat.install()
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke", file=sys.stderr)
        return 2
    import transformers
    import triton

    device = "cpu" if SMOKE else "cuda"
    checks, rows = [], []

    def check(name, ok, **extra):
        checks.append({"check": name, "ok": bool(ok), **extra})
        print(f"{'PASS' if ok else 'FAIL'} {name} {extra}", flush=True)

    names = ("out", "d_hidden", "d_weights", "d_gate_up", "d_down")
    # 1. checks ----------------------------------------------------------------------------------------
    medium = SMOKE_SHAPES["tiny"] if SMOKE else MEDIUM
    empty = (1, 5) if not SMOKE else (1,)
    for dtype in (torch.float32, torch.bfloat16):
        module, x, idx, w, dy = build(medium, dtype, device, empty)
        ours = fwd_bwd(variant_fn("foak", module), module, x, idx, w, dy)
        ref = fwd_bwd(variant_fn("loop", module), module, x, idx, w, dy)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for n, a, b in zip(names, ours, ref):
            check(f"medium {dtype} empty experts {empty}: foak vs eager loop {n} <= {tol}", rel(a, b) <= tol,
                  rel=rel(a, b))
        zero = all(int(torch.count_nonzero(ours[g][e])) == 0 for g in (3, 4) for e in empty)
        check(f"medium {dtype}: zero weight gradients for the empty experts", zero)
        del module, x, idx, w, dy, ours, ref
    for shape_name, shape in ({} if SMOKE else SHAPES).items():
        module, x, idx, w, dy = build(shape, torch.bfloat16, device)
        ours = fwd_bwd(variant_fn("foak", module), module, x, idx, w, dy)
        ref = fwd_bwd(variant_fn("grouped_mm", module), module, x, idx, w, dy)
        for n, a, b in zip(names, ours, ref):
            check(f"{shape_name} bf16: foak vs grouped_mm {n} <= 2e-2", rel(a, b) <= 2e-2, rel=rel(a, b))
        del module, x, idx, w, dy, ours, ref
        torch.cuda.empty_cache()

    # 2. timings ---------------------------------------------------------------------------------------
    if not SMOKE:
        for shape_name, shape in SHAPES.items():
            flops = 18 * shape["T"] * shape["k"] * shape["H"] * shape["I"]
            for name in args.variants.split(","):
                module, x, idx, w, dy = build(shape, torch.bfloat16, device)
                fn = variant_fn(name, module)
                torch.cuda.synchronize()
                start = time.perf_counter()
                fwd_bwd(fn, module, x, idx, w, dy)
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                module.gate_up_proj.grad = module.down_proj.grad = None
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fwd_bwd(fn, module, x, idx, w, dy)
                torch.cuda.synchronize()
                extra = (torch.cuda.max_memory_allocated() - base) / 2**20
                reps = args.reps if not (name == "loop" and shape["E"] > 16) else 3
                ms = timed_ms(lambda: fwd_bwd(fn, module, x, idx, w, dy), reps=reps, warmup=2)
                row = {"shape": shape_name, **shape, "variant": name, "ms": ms, "TFLOPs": flops / ms / 1e9,
                       "extra_MiB": extra, "first_s": first, "reps": reps}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del module, x, idx, w, dy, fn
                torch.cuda.empty_cache()

    meta = {"device": torch.cuda.get_device_name() if not SMOKE else "cpu (triton interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("moe_cpu_smoke.json" if SMOKE else "moe_h200.json")
    path.write_text(json.dumps({**meta, "checks": checks, "rows": rows}, indent=1))
    print(f"wrote {path}")
    if rows:
        print("| shape | variant | fwd+bwd ms | TFLOP/s | extra peak MiB | first call s |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['shape']} | {r['variant']} | {r['ms']:.2f} | {r['TFLOPs']:.0f} | {r['extra_MiB']:.0f} "
                  f"| {r['first_s']:.2f} |")
    print(f"{sum(c['ok'] for c in checks)} of {len(checks)} checks passed")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
