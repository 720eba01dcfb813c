"""foak's MoE experts op (foak.ops.moe.moe_experts) on the H200 vs transformers' experts backends (issue [moe]).

    python benchmarks/moe.py            # CUDA: checks, then fwd+bwd timings; JSON in $OUT (default ./out)
    python benchmarks/moe.py --cpu-smoke   # CPU, Triton interpreter, tiny shapes: the checks only

Shapes (bf16, SwiGLU experts, routing = softmax -> top-k -> renormalise over random logits):
Mixtral-like T=8192 E=8 top-2 H=4096 I=14336, Qwen3-MoE-like T=16384 E=128 top-8 H=2048 I=768.
Variants: ``loop`` (transformers' eager MixtralExperts forward: a Python loop over experts), ``grouped_mm``
(transformers' grouped_mm experts backend: torch._grouped_mm), ``foak`` (moe_experts), ``liger`` (Liger's
LigerFusedMoEFunction, when the wheel is installed; its first call autotunes). Times: CUDA-event
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

from foak.bench.measure import CheckLog, environment, install_interpreter_compat, peak_extra_mib
from foak.bench.measure import event_median_ms as timed_ms  # CUDA-event median

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

    if name == "liger":
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        return lambda x, idx, w: LigerFusedMoEFunction.apply(x, module.gate_up_proj, module.down_proj, idx, w)
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


def router_ms(shape, device):
    """transformers' MixtralTopKRouter fwd+bwd (logits GEMM, fp32 softmax, top-k, renormalise) vs its logits
    GEMM alone: the difference bounds what a fused router kernel could save per layer."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = MixtralConfig(hidden_size=shape["H"], num_local_experts=shape["E"], num_experts_per_tok=shape["k"])
    router = MixtralTopKRouter(cfg).to(device=device, dtype=torch.bfloat16)
    torch.nn.init.normal_(router.weight, std=0.02)
    x = torch.randn(shape["T"], shape["H"], device=device, dtype=torch.bfloat16, requires_grad=True)
    dw = torch.randn(shape["T"], shape["k"], device=device)
    dl = torch.randn(shape["T"], shape["E"], device=device, dtype=torch.bfloat16)

    def full():
        logits, scores, _ = router(x)
        torch.autograd.backward((scores, logits), (dw, dl))

    def gemm():
        logits = torch.nn.functional.linear(x, router.weight)
        logits.backward(dl)

    from foak.ops.moe_router import moe_route

    def foak_router():
        logits = torch.nn.functional.linear(x, router.weight)
        scores, _ = moe_route(logits, shape["k"], True)
        torch.autograd.backward((scores, logits), (dw, dl))

    logits = torch.nn.functional.linear(x, router.weight).detach()
    ours, ref = moe_route(logits, shape["k"], True)[0], router(x)[1].detach()
    return {"router_fwd_bwd_ms": timed_ms(full, reps=20, warmup=3),
            "logits_gemm_fwd_bwd_ms": timed_ms(gemm, reps=20, warmup=3),
            "foak_router_fwd_bwd_ms": timed_ms(foak_router, reps=20, warmup=3),
            "foak_vs_hf_weights_max_abs": (ours - ref).abs().max().item()}


def parts(shape, device):
    """Each piece of foak's forward and backward alone (CUDA-event medians), the grouped GEMMs also as one
    torch.mm per expert, to show where the time goes."""
    from foak.ops import moe as m
    from foak.ops.activations import _backward_launch, _forward_launch

    module, x, idx, w, dy = build(shape, torch.bfloat16, device)
    gu, dn = module.gate_up_proj.detach(), module.down_proj.detach()
    T, K, E, inter = shape["T"], shape["k"], shape["E"], shape["I"]
    flat = idx.reshape(-1)

    def route():
        order = torch.argsort(flat, stable=True)
        pos = torch.empty_like(order)
        pos[order] = torch.arange(order.numel(), device=device)
        per = torch.zeros(E, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
        return order, pos, per, torch.cumsum(per, 0, dtype=torch.int32)

    order, pos, per, offs = route()
    counts_host = per.tolist()
    src = order // K
    xs = x[src]
    h = m._gmm(xs, gu.transpose(1, 2), offs, lambda: counts_host)
    a = _forward_launch(h[:, :inter], h[:, inter:], "silu")
    y = m._gmm(a, dn.transpose(1, 2), offs, lambda: counts_host)
    pos2 = pos.view(T, K)
    dys, _ = m._combine_backward(dy, y, pos2, w)

    def loop_mm(a_, b_):
        out = a_.new_empty((a_.shape[0], b_.shape[-1]))
        start = 0
        for e, c in enumerate(counts_host):
            torch.mm(a_[start:start + c], b_[e], out=out[start:start + c])
            start += c
        return out

    def loop_w(a_, b_):
        out = a_.new_empty((E, a_.shape[1], b_.shape[1]))
        start = 0
        for e, c in enumerate(counts_host):
            torch.mm(a_[start:start + c].t(), b_[start:start + c], out=out[e])
            start += c
        return out

    da = m._gmm(dys, dn, offs, lambda: counts_host)
    dh = torch.empty_like(h)
    pieces = {
        "route (sort, positions, counts)": route,
        "gather xs": lambda: x[src],
        "gemm1 grouped": lambda: torch._grouped_mm(xs, gu.transpose(1, 2), offs=offs),
        "gemm1 per-expert mm": lambda: loop_mm(xs, gu.transpose(1, 2)),
        "glu fwd": lambda: _forward_launch(h[:, :inter], h[:, inter:], "silu"),
        "gemm2 grouped": lambda: torch._grouped_mm(a, dn.transpose(1, 2), offs=offs),
        "gemm2 per-expert mm": lambda: loop_mm(a, dn.transpose(1, 2)),
        "combine fwd": lambda: m._combine(y, pos2, w, torch.bfloat16),
        "combine bwd (dy, dw)": lambda: m._combine_backward(dy, y, pos2, w),
        "d_a grouped": lambda: torch._grouped_mm(dys, dn, offs=offs),
        "d_a per-expert mm": lambda: loop_mm(dys, dn),
        "glu bwd": lambda: _backward_launch(da, h[:, :inter], h[:, inter:], dh[:, :inter], dh[:, inter:], "silu",
                                            h=torch.empty_like(a)),
        "d_down grouped": lambda: torch._grouped_mm(dys.t(), a, offs=offs),
        "d_down per-expert mm": lambda: loop_w(dys, a),
        "d_gate_up grouped": lambda: torch._grouped_mm(dh.t(), xs, offs=offs),
        "d_gate_up per-expert mm": lambda: loop_w(dh, xs),
        "d_xs grouped": lambda: torch._grouped_mm(dh, gu, offs=offs),
        "d_xs per-expert mm": lambda: loop_mm(dh, gu),
        "combine d_hidden": lambda: m._combine(y, pos2, None, torch.bfloat16),
    }
    out = {}
    for name, fn in pieces.items():
        out[name] = timed_ms(fn, reps=10, warmup=2)
        print(f"part {name}: {out[name]:.3f} ms", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--variants", default="loop,grouped_mm,foak")
    parser.add_argument("--recompute-h", action="store_true", help="foak: moe_experts' recompute_h for the timings")
    parser.add_argument("--parts", action="store_true", help="time each piece of foak's op (Mixtral-like shape)")
    parser.add_argument("--shapes", default="mixtral,qwen3_moe")
    parser.add_argument("--router", action="store_true", help="time transformers' router at both shapes")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    if SMOKE:
        install_interpreter_compat()  # bf16 in the interpreter (the tests' layer)
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke", file=sys.stderr)
        return 2
    device = "cpu" if SMOKE else "cuda"
    checks, rows = CheckLog(), []
    check = checks.check

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
    part_ms = parts(SHAPES["mixtral"], device) if args.parts and not SMOKE else {}
    if args.router and not SMOKE:
        for shape_name, shape in SHAPES.items():
            part_ms[f"router {shape_name}"] = router_ms(shape, device)
            print(f"router {shape_name}: {part_ms[f'router {shape_name}']}", flush=True)
    if args.recompute_h:
        from foak.ops import moe as moe_mod

        moe_mod.TUNING["recompute_h"] = True
    if not SMOKE:
        for shape_name, shape in SHAPES.items():
            if shape_name not in args.shapes.split(","):
                continue
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
                extra = peak_extra_mib(lambda: fwd_bwd(fn, module, x, idx, w, dy))[0]
                reps = args.reps if not (name == "loop" and shape["E"] > 16) else 3
                ms = timed_ms(lambda: fwd_bwd(fn, module, x, idx, w, dy), reps=reps, warmup=2)
                row = {"shape": shape_name, **shape, "variant": name, "ms": ms, "TFLOPs": flops / ms / 1e9,
                       "extra_MiB": extra, "first_s": first, "reps": reps}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del module, x, idx, w, dy, fn
                torch.cuda.empty_cache()

    meta = {"environment": environment(init_cuda=not SMOKE),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("moe_cpu_smoke.json" if SMOKE else "moe_h200.json")
    meta["recompute_h"] = args.recompute_h
    path.write_text(json.dumps({**meta, "checks": checks, "parts_ms": part_ms, "rows": rows}, indent=1))
    print(f"wrote {path}")
    if rows:
        print("| shape | variant | fwd+bwd ms | TFLOP/s | extra peak MiB | first call s |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['shape']} | {r['variant']} | {r['ms']:.2f} | {r['TFLOPs']:.0f} | {r['extra_MiB']:.0f} "
                  f"| {r['first_s']:.2f} |")
    print(checks.summary())
    return 0 if checks.all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
