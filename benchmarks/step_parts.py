"""Pieces of a training step on the GPU, fwd+bwd bf16: the gated-MLP down projection with and without
keeping the product (foak glu_linear vs glu + F.linear, and eager torch), the RMSNorm-output recompute
(a norm feeding three projections, inside and outside the recompute scope), and SDPA's attention
backends at the step's attention shape. Correctness first (vs fp32 references), then time (CUDA events,
median of 20 after warm-up, spin kernel ahead of each call, see foak.bench.measure.spin_median_ms) and extra
peak memory.

    python3 benchmarks/step_parts.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from foak.bench.measure import MiB, environment, peak_extra_mib
from foak.bench.measure import spin_median_ms as cuda_median_ms

from foak.ops._recompute import recomputing_outputs  # noqa: E402
from foak.ops.activations import glu  # noqa: E402
from foak.ops.glu_linear import glu_linear, glu_linear_reference  # noqa: E402
from foak.ops.rms_norm import rms_norm, rms_norm_reference  # noqa: E402
from foak.testing import relative_error  # noqa: E402

DEV, DT = "cuda", torch.bfloat16


def fwd_bwd_ms_and_mib(make, fn):
    """make() -> (leaves, intermediates fed to fn, upstream grad); times fn's fwd+bwd only."""

    def prepare():
        return make()

    def run(leaves, ins, dout):
        out = fn(*ins)
        torch.autograd.grad(out, leaves, dout)

    ms = cuda_median_ms(run, prepare, warmup=5, reps=20)
    leaves, ins, dout = make()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # what peak_extra_mib measures from too
    saved = []

    def fwd_then_bwd():
        out = fn(*ins)
        saved.append(torch.cuda.memory_allocated() - base)  # what the forward leaves alive (output + saved)
        torch.autograd.grad(out, leaves, dout)

    peak_mib, _ = peak_extra_mib(fwd_then_bwd)
    return ms, saved[0] / MiB, peak_mib


def mlp_down(tokens, hidden, inter):
    w_d = (torch.randn(hidden, inter, device=DEV) * inter**-0.5).to(DT).requires_grad_()

    def make():
        g0 = torch.randn(tokens, inter, device=DEV, dtype=DT, requires_grad=True)
        u0 = torch.randn(tokens, inter, device=DEV, dtype=DT, requires_grad=True)
        return (g0, u0, w_d), (g0 * 1.0, u0 * 1.0), torch.randn(tokens, hidden, device=DEV, dtype=DT)

    variants = {
        "eager F.linear(silu(g)*u)": lambda g, u: F.linear(F.silu(g) * u, w_d),
        "foak glu + F.linear": lambda g, u: F.linear(glu(g, u), w_d),
        "foak glu_linear": lambda g, u: glu_linear(g, u, w_d),
    }
    # correctness of glu_linear at this shape vs an fp32 reference
    (g0, u0, _), (g, u), dout = make()
    out = glu_linear(g, u, w_d)
    grads = torch.autograd.grad(out, (g0, u0, w_d), dout)
    rg, ru, rw = (t.detach().float().requires_grad_() for t in (g0, u0, w_d))
    ref = glu_linear_reference(rg, ru, rw)
    ref_grads = torch.autograd.grad(ref, (rg, ru, rw), dout.float())
    errors = {"out": relative_error(out, ref)} | {
        f"grad_{n}": relative_error(a, b) for n, a, b in zip("guw", grads, ref_grads)}
    rows = {}
    for name, fn in variants.items():
        ms, saved, peak = fwd_bwd_ms_and_mib(make, fn)
        rows[name] = {"ms": ms, "forward_keeps_mib": saved, "peak_mib": peak}
    return {"errors": errors, "passed": all(e <= 1e-2 for e in errors.values()), "variants": rows}


def norm_into_projections(tokens, hidden, outs=(2048, 512, 512)):
    weights = [(torch.randn(o, hidden, device=DEV) * hidden**-0.5).to(DT).requires_grad_() for o in outs]
    w_n = (torch.rand(hidden, device=DEV) + 0.5).to(DT).requires_grad_()

    def block(x):
        y = rms_norm(x, w_n, 1e-5, inplace_backward=False)
        return sum(F.linear(y, w).float().square().mean() for w in weights)

    def make():
        x0 = torch.randn(tokens, hidden, device=DEV, dtype=DT, requires_grad=True)
        return (x0, w_n, *weights), (x0 * 1.0,), torch.ones((), device=DEV)

    def scoped(x):
        with recomputing_outputs():
            return block(x)

    (x0, *_), (x,), _ = make()
    leaves = (x0, w_n, *weights)
    plain_grads = torch.autograd.grad(block(x), leaves)
    scoped_grads = torch.autograd.grad(scoped(x0 * 1.0), leaves)
    identical = all(torch.equal(a, b) for a, b in zip(plain_grads, scoped_grads))
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref_y = rms_norm_reference(ref_leaves[0], ref_leaves[1], 1e-5)
    ref = sum(F.linear(ref_y, w).square().mean() for w in ref_leaves[2:])
    ref_grads = torch.autograd.grad(ref, ref_leaves)
    errors = {f"grad{i}": relative_error(a, b) for i, (a, b) in enumerate(zip(scoped_grads, ref_grads))}
    rows = {}
    for name, fn in {"rms_norm, output kept": block, "rms_norm, output recomputed": scoped}.items():
        ms, saved, peak = fwd_bwd_ms_and_mib(make, fn)
        rows[name] = {"ms": ms, "forward_keeps_mib": saved, "peak_mib": peak}
    return {"bit_identical": identical, "errors": errors,
            "passed": identical and all(e <= 2e-2 for e in errors.values()), "variants": rows}


def attention_backends(batch, heads, kv_heads, seq, head_dim):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make():
        q = torch.randn(batch, heads, seq, head_dim, device=DEV, dtype=DT, requires_grad=True)
        k = torch.randn(batch, kv_heads, seq, head_dim, device=DEV, dtype=DT, requires_grad=True)
        v = torch.randn(batch, kv_heads, seq, head_dim, device=DEV, dtype=DT, requires_grad=True)
        return (q, k, v), (q, k, v), torch.randn(batch, heads, seq, head_dim, device=DEV, dtype=DT)

    rows = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in (True, False):
            def fn(q, k, v, gqa=gqa, backend=backend):
                if not gqa:
                    rep = heads // kv_heads
                    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

            name = f"{backend.name.lower()}{' enable_gqa' if gqa else ' repeat_kv'}"
            try:
                ms, saved, peak = fwd_bwd_ms_and_mib(make, fn)
                rows[name] = {"ms": ms, "forward_keeps_mib": saved, "peak_mib": peak}
            except RuntimeError as err:
                rows[name] = {"error": str(err).splitlines()[0][:160]}
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    result = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "environment": environment(),
              "timing": "CUDA events, median of 20 fwd+bwd after 5 warm-up", "parts": {}}
    parts = result["parts"]
    parts["mlp down T16384 H2048 I8192 (Llama-1B)"] = mlp_down(16384, 2048, 8192)
    parts["mlp down T8192 H4096 I14336 (Llama-8B)"] = mlp_down(8192, 4096, 14336)
    parts["norm -> q,k,v T16384 H2048 (Llama-1B)"] = norm_into_projections(16384, 2048)
    parts["sdpa causal B4 H32/8 S4096 D128 (Llama-1B)"] = {"variants": attention_backends(4, 32, 8, 4096, 128)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "step_parts_h200.json").write_text(json.dumps(result, indent=1))
    for part, data in parts.items():
        status = "" if "passed" not in data else (" PASS" if data["passed"] else f" FAIL {data.get('errors')}")
        print(f"{part}:{status}")
        for name, row in data["variants"].items():
            if "error" in row:
                print(f"  {name:34s} error: {row['error']}")
            else:
                print(f"  {name:34s} {row['ms']:8.3f} ms  forward keeps {row['forward_keeps_mib']:7.0f} MiB"
                      f"  peak {row['peak_mib']:7.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
