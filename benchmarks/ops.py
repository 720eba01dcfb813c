#!/usr/bin/env python3
"""Correctness checks and fwd+bwd timings of foak's RMSNorm, RoPE and GLU ops against HF eager,
torch.compile and Liger, at the shapes of /work/shared/ANCHORS.md.

    python3 benchmarks/ops.py --out DIR                                  # on a CUDA GPU: everything
    TRITON_INTERPRET=1 python3 benchmarks/ops.py --cpu-smoke --out DIR   # CPU: the checks, tiny shapes

Writes DIR/ops_h200.json and prints a markdown table last; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import foak
from foak.bench.measure import SPIN_CYCLES, copy_bandwidth  # noqa: F401  (loss.py imports them from here too)
from foak.bench.measure import environment, peak_extra_mib
from foak.bench.measure import spin_median_ms as cuda_median_ms
from foak.ops import geglu_reference, rms_norm_reference, rope_reference, swiglu_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
AGREE_TOL = 2e-2  # foak vs HF eager at the benchmark shapes: both carry bf16 rounding
EPS = 1e-6
MiB = 2**20
CHECKS: list[dict] = []
START = time.perf_counter()


def log(*args):
    print(*args, flush=True)


def phase(title):
    log(f"== [{time.perf_counter() - START:5.0f} s] {title}")


def rnd(*shape, dev, dtype, grad=True):
    return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=grad)


def as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def record(name: str, errs: dict, tol: float, problem: str | None = None) -> None:
    ok = problem is None and all(v <= tol for v in errs.values())  # False for NaN too
    CHECKS.append({"name": name, "passed": ok, "tol": tol, "errors": errs, "problem": problem})
    detail = " ".join(f"{k}={v:.1e}" for k, v in errs.items())
    log(f"{'PASS' if ok else 'FAIL'}  {name:<58} {detail}  (tol {tol:.0e})" + (f"  !! {problem}" if problem else ""))


# 1. correctness -----------------------------------------------------------------------------------
def fwd_bwd(fn, inputs, grad_outs=None):
    """outs = fn(*inputs); grads of every input that requires grad. grad_outs default: randn_like."""
    outs = as_tuple(fn(*inputs))
    grad_outs = [torch.randn_like(o) for o in outs] if grad_outs is None else grad_outs
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return outs, torch.autograd.grad(outs, wrt, grad_outs), grad_outs


def check(name: str, dtype: torch.dtype, fn, ref_fn, inputs: dict) -> None:
    """Compare fn (foak) with ref_fn (reference) on upcast copies of the same inputs: every output and
    the gradient of every input that requires grad; dtypes and shapes must match; inputs stay unchanged."""
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32

    def up(t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        return t.detach().to(ref_dtype).requires_grad_(t.requires_grad)

    values = list(inputs.values())
    snapshot = {n: t.detach().clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    label = f"{name} {str(dtype).removeprefix('torch.')}"
    try:
        with torch.no_grad():  # output dtypes/shapes the reference gives at the native dtype
            native = as_tuple(ref_fn(*values))
        outs, grads, dys = fwd_bwd(fn, values)
        refs, ref_grads, _ = fwd_bwd(ref_fn, [up(t) for t in values], [d.to(ref_dtype) for d in dys])
    except Exception as e:  # a crash is a failed check, not a crashed benchmark
        record(label, {}, TOL[dtype], f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return
    wrt = {n: t for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    errs = {f"out{i}": rel_err(o, r) for i, (o, r) in enumerate(zip(outs, refs))}
    errs |= {f"d{n}": rel_err(g, r) for n, g, r in zip(wrt, grads, ref_grads)}
    pairs = [(f"out{i}", o, r) for i, (o, r) in enumerate(zip(outs, native))]
    pairs += [(f"d{n}", g, t) for (n, t), g in zip(wrt.items(), grads)]
    problems = [f"{n} is {a.dtype}{tuple(a.shape)}, expected {b.dtype}{tuple(b.shape)}"
                for n, a, b in pairs if (a.dtype, a.shape) != (b.dtype, b.shape)]
    problems += [f"input {n} was modified" for n, t in snapshot.items() if not torch.equal(inputs[n], t)]
    record(label, errs, TOL[dtype], "; ".join(problems) or None)


def rms_checks(dev, dtype, cap):
    def go(name, mode, inputs, view=lambda x: x):
        def body(op):
            return lambda x, w, r=None: op(view(x), w, EPS, mode, r)
        check(f"rms_norm {mode} {name}", dtype, body(foak.rms_norm), body(rms_norm_reference), inputs)

    def rn(*shape, dt=dtype):
        return rnd(*shape, dev=dev, dtype=dt)

    cases = [((37, 129), "llama", False), ((cap(1000), 4096), "gemma", False), ((cap(4097), 5000), "llama", True),
             ((2, cap(300), 4096), "gemma", True), ((cap(1000), 20000), "llama", False),
             ((cap(37), 20000), "gemma", True), ((3, 20000), "llama", True)]
    for shape, mode, res in cases:
        go(f"{'+residual ' if res else ''}{shape}", mode,
           {"x": rn(*shape), "w": rn(shape[-1])} | ({"r": rn(*shape)} if res else {}))
    rows = cap(1000)
    go(f"x[:, :4096] of [{rows},5000]", "llama", {"x": rn(rows, 5000), "w": rn(4096)}, lambda x: x[:, :4096])
    go("x.t() of [129,37]", "gemma", {"x": rn(129, 37), "w": rn(129)}, lambda x: x.t())
    if dtype != torch.float32:
        go(f"fp32 weight {(rows, 4096)}", "llama", {"x": rn(rows, 4096), "w": rn(4096, dt=torch.float32)})


def rope_checks(dev, dtype, cap):
    def case(label, B, S, Hq, Hkv, D, R, cs_batch=1, packed=None, hf_layout=True, table_dtype=None):
        S, tdt = cap(S), table_dtype or dtype
        shape = (lambda H: (B, S, H, D)) if hf_layout else (lambda H: (B, H, S, D))
        q, k = rnd(*shape(Hq), dev=dev, dtype=dtype), rnd(*shape(Hkv), dev=dev, dtype=dtype)
        pos = None
        if packed is None:  # random tables: stronger than HF's, whose two halves are equal
            cos, sin = (rnd(cs_batch, S, R, dev=dev, dtype=tdt, grad=False) for _ in range(2))
        else:  # row 0 packs sequences whose positions restart; other rows are shifted ranges
            row0 = torch.cat([torch.arange(n) for n in (10, 15, S - 25)])
            pos = torch.stack([row0] + [torch.arange(S) + 3 * b for b in range(1, packed)]).to(dev)
            cos, sin = (rnd(S + 3 * packed, R, dev=dev, dtype=tdt, grad=False) for _ in range(2))
        tr = (lambda t: t.transpose(1, 2)) if hf_layout else (lambda t: t)

        def body(op):
            return lambda q, k, cos, sin, pos: op(tr(q), tr(k), cos, sin, pos)

        tables = f"tables[{cos.shape[0]},{R}]+pos[{packed},{S}]" if packed else f"cos[{cs_batch},{S},{R}]"
        check(f"rope {label} q[{B},{Hq},{S},{D}] k[{B},{Hkv},.,.] {tables}", dtype, body(foak.rope),
              body(rope_reference), {"q": q, "k": k, "cos": cos, "sin": sin, "pos": pos})

    case("gqa hf-layout", 2, 37, 7, 3, 64, 64)
    case("gqa hf-layout", 3, 100, 8, 2, 128, 128, cs_batch=3)
    case("partial", 2, 33, 5, 1, 96, 32, cs_batch=2)
    case("packed", 2, 60, 7, 3, 64, 64, packed=2)
    case("packed partial contiguous", 1, 45, 4, 2, 80, 48, packed=1, hf_layout=False, table_dtype=torch.float32)


def glu_checks(dev, dtype, cap):
    acts = {"swiglu": (foak.swiglu, swiglu_reference),
            "geglu": (lambda g, u: foak.geglu(g, u, "none"), lambda g, u: geglu_reference(g, u, "none")),
            "geglu tanh": (lambda g, u: foak.geglu(g, u, "tanh"), lambda g, u: geglu_reference(g, u, "tanh"))}
    # (how g, u reach the op, their shape, shape of the fused input gu they are cut from, body given the op)
    layouts = [
        ("leaves", (37, 129), None, lambda op: lambda g, u: op(g, u)),
        ("clones (in-place bwd)", (cap(1000), 5000), None, lambda op: lambda g, u: op(g.clone(), u.clone())),
        ("clone(gu).chunk(2,-1)", (2, cap(300), 4096), (2, cap(300), 8192),
         lambda op: lambda gu: op(*gu.clone().chunk(2, -1))),
        ("leaf gu.chunk(2,-1)", (cap(4097), 4096), (cap(4097), 8192), lambda op: lambda gu: op(*gu.chunk(2, -1))),
    ]
    aliasing = [  # non-overlapping views: the op may not overwrite a leaf and must not crash
        ("views of leaves", (cap(200), 256), None, lambda op: lambda g, u: op(g.view(g.shape), u.view(u.shape))),
        ("clone(gu).chunk(2,0)", (cap(200), 256), (2 * cap(200), 256),
         lambda op: lambda gu: op(*gu.clone().chunk(2, 0))),
    ]
    for act, (foak_op, ref_op) in acts.items():
        for lay, shape, fused, body in layouts + (aliasing if act == "swiglu" else []):
            inputs = {"gu": rnd(*fused, dev=dev, dtype=dtype)} if fused else \
                {n: rnd(*shape, dev=dev, dtype=dtype) for n in "gu"}
            check(f"{act} {lay} {shape}", dtype, body(foak_op), body(ref_op), inputs)


def compile_check(dev, backend="inductor"):
    """torch.compile(fullgraph=True) of one function calling the three ops == eager foak (bf16)."""
    def block(x, r, w, qs, ks, cos, sin, g, u):
        y, s = foak.rms_norm(x, w, EPS, "llama", r)
        q, k = foak.rope(qs.transpose(1, 2), ks.transpose(1, 2), cos, sin)
        h = foak.swiglu(g * 2.0, u + 1.0)  # intermediates: eager takes the in-place backward
        return y, s, q, k, h

    shapes = [(2, 37, 4096), (2, 37, 4096), (4096,), (2, 37, 8, 128), (2, 37, 2, 128), (1, 37, 128), (1, 37, 128),
              (74, 1000), (74, 1000)]
    inputs = [rnd(*sh, dev=dev, dtype=torch.bfloat16, grad=i not in (5, 6)) for i, sh in enumerate(shapes)]
    name = f"torch.compile(fullgraph, {backend}) rms_norm+rope+swiglu == eager bf16"
    try:
        outs, grads, dys = fwd_bwd(block, inputs)
        c_outs, c_grads, _ = fwd_bwd(torch.compile(block, fullgraph=True, backend=backend), inputs, dys)
    except Exception as e:
        record(name, {}, 1e-3, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return
    errs = {f"out{i}": rel_err(c, o) for i, (c, o) in enumerate(zip(c_outs, outs))}
    errs |= {f"d{n}": rel_err(c, g) for n, c, g in zip(["x", "r", "w", "q", "k", "g", "u"], c_grads, grads)}
    record(name, errs, 1e-3)


# 2. timing ----------------------------------------------------------------------------------------
def fresh(inputs0, dys0):
    """Non-leaf clones of the inputs (nn.Parameters are used as they are) and of the upstream grads."""
    ins = [t if isinstance(t, torch.nn.Parameter) else t.clone() for t in inputs0]
    return ins, [d.clone() for d in dys0]


def timed_fwd_bwd(fn, ins, dys):
    outs = as_tuple(fn(*ins))
    return outs, torch.autograd.grad(outs, ins, dys)


def extra_peak_mib(fn, inputs0, dys0) -> float:
    ins, dys = fresh(inputs0, dys0)
    return peak_extra_mib(lambda: timed_fwd_bwd(fn, ins, dys))[0]  # outputs and grads stay alive until measured


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def load_liger():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as e:
        log(f"liger-kernel not importable ({type(e).__name__}: {e}); its rows are n/a")
        return None
    return LigerRMSNormFunction, LigerRopeFunction, LigerSiLUMulFunction


def bench_specs(liger, dev="cuda", T=16384, H=4096, I=14336, B=4, S=4096, Hq=32, Hkv=8, D=128):
    """One entry per table row: inputs (leaves; Parameters are not cloned), variants, floor bytes.
    A variant that is None could not be imported (n/a); one that is absent has no such kernel."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    bf16 = torch.bfloat16
    lig_rms, lig_rope, lig_silu = liger or (None, None, None)

    x, r = rnd(T, H, dev=dev, dtype=bf16), rnd(T, H, dev=dev, dtype=bf16)
    norm = LlamaRMSNorm(H, eps=EPS).to(dev, bf16)
    norm.weight = w = torch.nn.Parameter(1.0 + 0.1 * torch.randn(H, device=dev, dtype=bf16))

    def eager_rms(x, w):
        return norm(x)

    def eager_rms_res(x, r, w):
        s = x + r
        return norm(s), s

    # HF layout: q, k are [B, H, S, D] views of [B, S, H, D] storage; cos/sin [B, S, D] = cat(freqs, freqs)
    q = torch.randn(B, S, Hq, D, device=dev, dtype=bf16).transpose(1, 2).requires_grad_()
    k = torch.randn(B, S, Hkv, D, device=dev, dtype=bf16).transpose(1, 2).requires_grad_()
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D)
    freqs = torch.arange(S, device=dev, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).expand(B, S, D).contiguous()
    cos, sin = emb.cos().to(bf16), emb.sin().to(bf16)

    def eager_rope(q, k):
        return apply_rotary_pos_emb(q, k, cos, sin)

    g, u = rnd(T, I, dev=dev, dtype=bf16), rnd(T, I, dev=dev, dtype=bf16)

    def eager_swiglu(g, u):
        return F.silu(g) * u

    def eager_geglu(g, u):
        return F.gelu(g, approximate="tanh") * u

    def variants(eager, foak_fn, **liger_fn):
        return dict(eager=eager, compile=torch.compile(eager), **liger_fn, foak=foak_fn)

    return [
        dict(op=f"RMSNorm x[{T},{H}] w[{H}]", inputs=[x, w], floor=nbytes(x) * 5 + nbytes(w) * 3,
             variants=variants(eager_rms, lambda x, w: foak.rms_norm(x, w, EPS),
                               liger=lig_rms and (lambda x, w: lig_rms.apply(x, w, EPS, 0.0, "llama", True)))),
        dict(op="RMSNorm + residual add (same x)", inputs=[x, r, w], floor=nbytes(x) * 8 + nbytes(w) * 3,
             variants=variants(eager_rms_res, lambda x, r, w: foak.rms_norm(x, w, EPS, residual=r))),
        dict(op=f"RoPE q[{B},{Hq},{S},{D}] k[{B},{Hkv},{S},{D}]", inputs=[q, k],
             floor=nbytes(q, k) * 4 + nbytes(cos, sin),
             variants=variants(eager_rope, lambda q, k: foak.rope(q, k, cos, sin),
                               liger=lig_rope and (lambda q, k: lig_rope.apply(q, k, cos, sin)))),
        dict(op=f"SwiGLU g,u[{T},{I}]", inputs=[g, u], floor=nbytes(g) * 8,
             variants=variants(eager_swiglu, foak.swiglu, liger=lig_silu and (lambda g, u: lig_silu.apply(g, u)))),
        dict(op=f"GeGLU tanh g,u[{T},{I}]", inputs=[g, u], floor=nbytes(g) * 8,
             variants=variants(eager_geglu, lambda g, u: foak.geglu(g, u, "tanh"))),
    ]


def time_variant(spec, fn, row, first_pass, warmup, reps):
    outs = as_tuple(fn(*fresh(spec["inputs"], [])[0]))
    # the same upstream grads for every variant, laid out like this variant's outputs
    spec.setdefault("dys", [torch.randn_like(o) for o in outs])
    dys0 = [torch.empty_like(o).copy_(d) for o, d in zip(outs, spec["dys"])]
    del outs
    host = []
    ms = cuda_median_ms(lambda ins, dys: timed_fwd_bwd(fn, ins, dys), lambda: fresh(spec["inputs"], dys0),
                        warmup, reps, host)
    row["runs_ms"].append(ms)
    row.setdefault("host_issue_ms", []).append(statistics.median(host))
    if first_pass:
        row["extra_peak_mib"] = extra_peak_mib(fn, spec["inputs"], dys0)
        row["result"] = timed_fwd_bwd(fn, *fresh(spec["inputs"], dys0))  # for agreement(), then dropped


def run_timings(specs, bandwidth, warmup, reps):
    results = {}
    for run in (1, 2):
        log(f"-- timing pass {run} (median of {reps} after {warmup} warm-up, fwd+bwd, bf16)")
        for spec in specs:
            rows = results.setdefault(spec["op"], {"floor_bytes": spec["floor"], "variants": {},
                                                   "floor_ms": spec["floor"] / bandwidth * 1e3})
            for name, fn in spec["variants"].items():
                row = rows["variants"].setdefault(name, {"runs_ms": []})
                if fn is None:
                    row["error"] = "n/a (not importable)"
                if "error" in row:
                    continue
                try:
                    time_variant(spec, fn, row, run == 1, warmup, reps)
                    log(f"   {spec['op']:<40} {name:<8} {row['runs_ms'][-1]:8.3f} ms")
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    log(f"   {spec['op']:<40} {name:<8} {row['error']}")
                    if name == "foak":
                        record(f"foak runs at bench shape: {spec['op']}", {}, 0.0, row["error"])
            if run == 1:
                agreement(spec["op"], rows["variants"])
    return results


def profile_host(specs, calls=10) -> dict:
    """cProfile of foak's host-side path (Python, dispatch, launches) per op: the top functions by own time."""
    import cProfile
    import io
    import pstats

    report = {}
    for spec in specs:
        fn = spec["variants"]["foak"]
        outs = as_tuple(fn(*fresh(spec["inputs"], [])[0]))
        dys = [torch.randn_like(o) for o in outs]
        del outs
        prepared = [fresh(spec["inputs"], dys) for _ in range(calls)]
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES * 5)
        prof = cProfile.Profile()
        prof.enable()
        for ins, d in prepared:
            timed_fwd_bwd(fn, ins, d)
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        report[spec["op"]] = text.getvalue()
        log(f"-- host profile of foak, {spec['op']} ({calls} fwd+bwd calls)\n{text.getvalue()}")
        del prepared
    return report


def agreement(op, variants):
    """Every variant's outputs and grads vs HF eager's (same inputs and upstream grads)."""
    ref = variants.get("eager", {}).pop("result", None)
    for name, row in variants.items():
        got = row.pop("result", None)
        if ref is None or got is None or name == "eager":
            continue
        errs = [rel_err(a, b) for a, b in zip(got[0] + got[1], ref[0] + ref[1])]
        row["max_rel_err_vs_eager"] = max(errs)
        if name == "foak":
            record(f"foak == HF eager at bench shape: {op}", {"max": max(errs)}, AGREE_TOL)
    del ref


# 3. report ----------------------------------------------------------------------------------------
def header(smoke: bool) -> dict:
    h = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "environment": environment(init_cuda=not smoke)}
    if not smoke:
        h["copy_bandwidth_GBps"] = copy_bandwidth() / 1e9
    for k, v in {**h["environment"], **{k: v for k, v in h.items() if k != "environment"}}.items():
        log(f"{k:>20}: {v:.1f}" if isinstance(v, float) else f"{k:>20}: {v}")
    return h


def fmt(row):
    if row is None:
        return "—"
    if "error" in row or not row["runs_ms"]:
        return "n/a"
    return " / ".join(f"{t:.3f}" for t in row["runs_ms"]) + f" ({row.get('extra_peak_mib', float('nan')):.0f})"


def summarise(timings) -> list[str]:
    lines = ["| op | eager ms (MiB) | compile ms (MiB) | liger ms (MiB) | foak ms (MiB) | floor ms | "
             "foak vs best of compile/liger |", "|---|---|---|---|---|---|---|"]
    for op, rows in timings.items():
        v = rows["variants"]
        best = {n: min(r["runs_ms"]) for n, r in v.items() if r["runs_ms"] and "error" not in r}
        rivals = [best[n] for n in ("compile", "liger") if n in best]
        ratio = best["foak"] / min(rivals) if "foak" in best and rivals else None
        rows["foak_ratio_vs"] = {n: best["foak"] / t for n, t in best.items() if "foak" in best and n != "foak"}
        rows["foak_ratio_vs_best_compile_liger"] = ratio
        rows["foak_over_floor"] = best["foak"] / rows["floor_ms"] if "foak" in best else None
        cells = [fmt(v.get(n)) for n in ("eager", "compile", "liger", "foak")]
        lines.append(f"| {op} | " + " | ".join(cells) + f" | {rows['floor_ms']:.3f} | "
                     + (f"{ratio:.2f}x |" if ratio else "n/a |"))
    lines.append("ms: GPU time, medians of timing pass 1 / pass 2 (host launch overhead hidden); MiB: extra peak "
                 "memory of one fwd+bwd (outputs and grads alive); ratio: foak / faster rival, best pass each "
                 "(<1 means foak is faster).")
    host = {op: {n: min(r["host_issue_ms"]) for n, r in rows["variants"].items() if r.get("host_issue_ms")}
            for op, rows in timings.items()}
    lines.append("host issue time per fwd+bwd call, ms: " + "; ".join(
        f"{op.split()[0]}: " + ", ".join(f"{n} {t:.3f}" for n, t in h.items()) for op, h in host.items()))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results", help="directory for ops_h200.json")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="CPU only (set TRITON_INTERPRET=1): correctness checks at tiny shapes, no timing")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        parser.error("no CUDA device; use --cpu-smoke with TRITON_INTERPRET=1")
    dev = "cpu" if smoke else "cuda"
    torch.manual_seed(0)
    result = {"header": header(smoke)}

    phase("correctness: foak vs reference (fp32 vs fp64 ref, bf16 vs fp32 ref of the same bf16 inputs)")
    cap = (lambda n: min(n, 40)) if smoke else (lambda n: n)
    for dtype in (torch.float32, torch.bfloat16):
        for checks in (rms_checks, rope_checks, glu_checks):
            checks(dev, dtype, cap)
    timings = {}
    if not smoke:
        phase("torch.compile check")
        compile_check(dev)
        phase("timings")
        try:
            specs = bench_specs(load_liger())
            timings = run_timings(specs, result["header"]["copy_bandwidth_GBps"] * 1e9, args.warmup, args.reps)
            phase("host-side profile of foak")
            result["host_profile"] = profile_host(specs)
        except Exception as e:  # keep the checks' results
            record("timing section ran", {}, 0.0, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    table = summarise(timings) if timings else []
    failed = [c["name"] for c in CHECKS if not c["passed"]]
    result |= {"checks": CHECKS, "timings": timings, "failed_checks": failed, "table_md": table}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ops_h200.json").write_text(json.dumps(result, indent=1))
    phase(f"{len(CHECKS) - len(failed)}/{len(CHECKS)} checks passed; wrote {out / 'ops_h200.json'}")
    for name in failed:
        log(f"   FAILED: {name}")
    log("\n" + "\n".join(table or ["(no timings with --cpu-smoke)"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
