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
import importlib.metadata
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import foak  # noqa: E402
from foak.ops import geglu_reference, rms_norm_reference, rope_reference, swiglu_reference  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
AGREE_TOL = 2e-2  # foak vs HF eager at the benchmark shapes: both carry bf16 rounding
EPS = 1e-6
MiB = 2**20
CHECKS: list[dict] = []


def log(*args):
    print(*args, flush=True)


def as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def record(name: str, errs: dict, tol: float, problem: str | None = None) -> None:
    finite = all(v == v and v != float("inf") for v in errs.values())
    ok = problem is None and finite and all(v <= tol for v in errs.values())
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


def check(name: str, dtype: torch.dtype, body, inputs: dict) -> None:
    """Compare body(foak ops) with body(reference ops) on upcast copies of the same inputs:
    every output and the gradient of every input that requires grad. Leaves must stay unchanged."""
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32

    def up(t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        return t.detach().to(ref_dtype).requires_grad_(t.requires_grad)

    names, values = list(inputs), list(inputs.values())
    tensors = [t for t in values if isinstance(t, torch.Tensor)]
    snapshot = [t.detach().clone() for t in tensors]
    label = f"{name} {str(dtype).removeprefix('torch.')}"
    try:
        with torch.no_grad():  # output dtypes/shapes the reference gives at the native dtype
            native = as_tuple(body("ref")(*values))
        outs, grads, dys = fwd_bwd(body("foak"), values)
        ref_vals = [up(t) for t in values]
        refs, ref_grads, _ = fwd_bwd(body("ref"), ref_vals, [d.to(ref_dtype) for d in dys])
    except Exception as e:  # a crash is a failed check, not a crashed benchmark
        record(label, {}, TOL[dtype], f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return
    errs = {f"out{i}": rel_err(o, r) for i, (o, r) in enumerate(zip(outs, refs))}
    wrt = [n for n, t in zip(names, values) if isinstance(t, torch.Tensor) and t.requires_grad]
    errs |= {f"d{n}": rel_err(g, r) for n, g, r in zip(wrt, grads, ref_grads)}
    problems = [f"out{i} {o.dtype}{tuple(o.shape)} != {r.dtype}{tuple(r.shape)}"
                for i, (o, r) in enumerate(zip(outs, native)) if (o.dtype, o.shape) != (r.dtype, r.shape)]
    leaves = [t for t in values if isinstance(t, torch.Tensor) and t.requires_grad]
    problems += [f"d{n} {g.dtype}{tuple(g.shape)}" for n, g, t in zip(wrt, grads, leaves)
                 if (g.dtype, g.shape) != (t.dtype, t.shape)]
    problems += [f"input {n} was modified" for n, t, s in zip(names, tensors, snapshot) if not torch.equal(t, s)]
    record(label, errs, TOL[dtype], "; ".join(problems) or None)


def rms_checks(dev, dtype, cap):
    def body(mode, view=lambda x: x):
        def make(which):
            op = foak.rms_norm if which == "foak" else rms_norm_reference
            return lambda x, w, r=None: op(view(x), w, EPS, mode, r)
        return make

    def rnd(*shape, dt=dtype, grad=True):
        return torch.randn(*shape, device=dev, dtype=dt, requires_grad=grad)

    cases = [((37, 129), "llama", False), ((cap(1000), 4096), "gemma", False), ((cap(4097), 5000), "llama", True),
             ((2, cap(300), 4096), "gemma", True), ((cap(1000), 20000), "llama", False),
             ((cap(37), 20000), "gemma", True), ((3, 20000), "llama", True)]
    for shape, mode, res in cases:
        inputs = {"x": rnd(*shape), "w": rnd(shape[-1])} | ({"r": rnd(*shape)} if res else {})
        check(f"rms_norm {mode}{' +residual' if res else ''} {shape}", dtype, body(mode), inputs)
    rows = cap(1000)
    check(f"rms_norm llama x[:, :4096] of [{rows},5000]", dtype, body("llama", lambda x: x[:, :4096]),
          {"x": rnd(rows, 5000), "w": rnd(4096)})
    check("rms_norm gemma x.t() of [129,37]", dtype, body("gemma", lambda x: x.t()), {"x": rnd(129, 37), "w": rnd(37)})
    if dtype != torch.float32:
        check(f"rms_norm llama fp32 weight {(rows, 4096)}", dtype, body("llama"),
              {"x": rnd(rows, 4096), "w": rnd(4096, dt=torch.float32)})


def rope_checks(dev, dtype, cap):
    def case(label, B, S, Hq, Hkv, D, R, cs_batch=1, packed=None, hf_layout=True, table_dtype=None):
        S = cap(S)
        tdt = table_dtype or dtype
        shape = (lambda H: (B, S, H, D)) if hf_layout else (lambda H: (B, H, S, D))
        q = torch.randn(*shape(Hq), device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(*shape(Hkv), device=dev, dtype=dtype, requires_grad=True)
        pos = None
        if packed is None:  # random tables: stronger than HF's, whose two halves are equal
            cos, sin = (torch.randn(cs_batch, S, R, device=dev, dtype=tdt) for _ in range(2))
        else:  # row 0 packs sequences whose positions restart; other rows are shifted ranges
            row0 = torch.cat([torch.arange(n) for n in (10, 15, S - 25)])
            pos = torch.stack([row0] + [torch.arange(S) + 3 * b for b in range(1, packed)]).to(dev)
            cos, sin = (torch.randn(S + 3 * packed, R, device=dev, dtype=tdt) for _ in range(2))
        tr = (lambda t: t.transpose(1, 2)) if hf_layout else (lambda t: t)

        def body(which):
            op = foak.rope if which == "foak" else rope_reference
            return lambda q, k, cos, sin, pos: op(tr(q), tr(k), cos, sin, pos)

        tables = f"tables[{cos.shape[0]},{R}]+pos[{packed},{S}]" if packed else f"cos[{cs_batch},{S},{R}]"
        name = f"rope {label} q[{B},{Hq},{S},{D}] k[{B},{Hkv},.,.] {tables}"
        check(name, dtype, body, {"q": q, "k": k, "cos": cos, "sin": sin, "pos": pos})

    case("gqa hf-layout", 2, 37, 7, 3, 64, 64)
    case("gqa hf-layout", 3, 100, 8, 2, 128, 128, cs_batch=3)
    case("partial", 2, 33, 5, 1, 96, 32, cs_batch=2)
    case("packed", 2, 60, 7, 3, 64, 64, packed=2)
    case("packed partial contiguous", 1, 45, 4, 2, 80, 48, packed=1, hf_layout=False, table_dtype=torch.float32)


def glu_checks(dev, dtype, cap):
    acts = {"swiglu": (foak.swiglu, swiglu_reference),
            "geglu": (lambda g, u: foak.geglu(g, u, "none"), lambda g, u: geglu_reference(g, u, "none")),
            "geglu tanh": (lambda g, u: foak.geglu(g, u, "tanh"), lambda g, u: geglu_reference(g, u, "tanh"))}
    layouts = {  # how g, u reach the op
        "leaves": (2, lambda op: lambda g, u: op(g, u)),
        "clones (in-place bwd)": (2, lambda op: lambda g, u: op(g.clone(), u.clone())),
        "clone(gu).chunk(2,-1)": (1, lambda op: lambda gu: op(*gu.clone().chunk(2, -1))),
        "leaf gu.chunk(2,-1)": (1, lambda op: lambda gu: op(*gu.chunk(2, -1))),
    }
    aliasing = {  # non-overlapping views: may not overwrite a leaf, must not crash
        "views of leaves": (2, lambda op: lambda g, u: op(g.view(g.shape), u.view(u.shape))),
        "clone(gu).chunk(2,0)": (1, lambda op: lambda gu: op(*gu.clone().chunk(2, 0))),
    }
    shapes = [(37, 129), (cap(1000), 5000), (2, cap(300), 4096)]
    for act, (foak_op, ref_op) in acts.items():
        cases = list(zip(layouts, shapes + [(cap(4097), 4096)]))
        cases += [(lay, (cap(200), 256)) for lay in (aliasing if act == "swiglu" else [])]
        for lay, shape in cases:
            n_in, make = (layouts | aliasing)[lay]
            if n_in == 2:
                inputs = {n: torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True) for n in "gu"}
            else:
                wide = (2 * shape[0], *shape[1:]) if "chunk(2,0)" in lay else (*shape[:-1], 2 * shape[-1])
                inputs = {"gu": torch.randn(*wide, device=dev, dtype=dtype, requires_grad=True)}
            check(f"{act} {lay} {shape}", dtype,
                  lambda which: make(foak_op if which == "foak" else ref_op), inputs)


def compile_check(dev, backend="inductor"):
    """torch.compile(fullgraph=True) of one function calling the three ops == eager foak (bf16)."""
    def block(x, r, w, qs, ks, cos, sin, g, u):
        y, s = foak.rms_norm(x, w, EPS, "llama", r)
        q, k = foak.rope(qs.transpose(1, 2), ks.transpose(1, 2), cos, sin)
        h = foak.swiglu(g * 2.0, u + 1.0)  # intermediates: eager takes the in-place backward
        return y, s, q, k, h

    def rnd(*shape, grad=True):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, requires_grad=grad)

    inputs = [rnd(2, 37, 4096), rnd(2, 37, 4096), rnd(4096), rnd(2, 37, 8, 128), rnd(2, 37, 2, 128),
              rnd(1, 37, 128, grad=False), rnd(1, 37, 128, grad=False), rnd(74, 1000), rnd(74, 1000)]
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
def cuda_median_ms(run, prepare=lambda: (), warmup=10, reps=50) -> float:
    """Median of CUDA-event times of run(*prepare()); prepare() is enqueued outside the events."""
    for _ in range(warmup):
        run(*prepare())
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        args = prepare()
        start.record()
        run(*args)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def copy_bandwidth() -> float:
    src = torch.ones(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_median_ms(lambda: dst.copy_(src), warmup=5, reps=20)
    return 2 * src.numel() / (ms * 1e-3)


def fresh(inputs0, dys0):
    """Non-leaf clones of the inputs (nn.Parameters are used as they are) and of the upstream grads."""
    ins = [t if isinstance(t, torch.nn.Parameter) else t.clone() for t in inputs0]
    return ins, [d.clone() for d in dys0]


def timed_fwd_bwd(fn, ins, dys):
    outs = as_tuple(fn(*ins))
    return outs, torch.autograd.grad(outs, ins, dys)


def extra_peak_mib(fn, inputs0, dys0) -> float:
    ins, dys = fresh(inputs0, dys0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = timed_fwd_bwd(fn, ins, dys)  # outputs and grads stay alive until measured
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak / MiB


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
    return {
        # forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None)
        "rms": lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", True),
        # forward(ctx, q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None)
        "rope": lambda cos, sin: (lambda q, k: LigerRopeFunction.apply(q, k, cos, sin)),
        # forward(ctx, a, b, gate_multiplier=1.0, down_multiplier=1.0)
        "swiglu": lambda g, u: LigerSiLUMulFunction.apply(g, u),
    }


def bench_specs(liger):
    """One entry per table row: inputs (leaves; Parameters are not cloned), variants, floor bytes."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    dev, bf16 = "cuda", torch.bfloat16

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=bf16, requires_grad=True)

    T, H = 16384, 4096
    x, r = leaf(T, H), leaf(T, H)
    norm = LlamaRMSNorm(H, eps=EPS).to(dev, bf16)
    norm.weight = w = torch.nn.Parameter(1.0 + 0.1 * torch.randn(H, device=dev, dtype=bf16))

    def eager_rms(x, w):
        return norm(x)

    def eager_rms_res(x, r, w):
        s = x + r
        return norm(s), s

    B, S, Hq, Hkv, D = 4, 4096, 32, 8, 128
    q = torch.randn(B, S, Hq, D, device=dev, dtype=bf16).transpose(1, 2).requires_grad_()
    k = torch.randn(B, S, Hkv, D, device=dev, dtype=bf16).transpose(1, 2).requires_grad_()
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D)
    freqs = torch.arange(S, device=dev, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).expand(B, S, D).contiguous()
    cos, sin = emb.cos().to(bf16), emb.sin().to(bf16)

    def eager_rope(q, k):
        return apply_rotary_pos_emb(q, k, cos, sin)

    g, u = leaf(T, 14336), leaf(T, 14336)

    def eager_swiglu(g, u):
        return F.silu(g) * u

    def eager_geglu(g, u):
        return F.gelu(g, approximate="tanh") * u

    na = None  # a liger variant that should exist but could not be imported
    return [
        dict(op="RMSNorm x[16384,4096] w[4096]", inputs=[x, w], floor=nbytes(x) * 5 + nbytes(w) * 3,
             variants=dict(eager=eager_rms, compile=torch.compile(eager_rms), liger=liger["rms"] if liger else na,
                           foak=lambda x, w: foak.rms_norm(x, w, EPS))),
        dict(op="RMSNorm + residual (fused add)", inputs=[x, r, w], floor=nbytes(x) * 8 + nbytes(w) * 3,
             variants=dict(eager=eager_rms_res, compile=torch.compile(eager_rms_res),
                           foak=lambda x, r, w: foak.rms_norm(x, w, EPS, residual=r))),
        dict(op="RoPE q[4,32,4096,128] k[4,8,4096,128]", inputs=[q, k], floor=nbytes(q, k) * 4 + nbytes(cos, sin),
             variants=dict(eager=eager_rope, compile=torch.compile(eager_rope),
                           liger=liger["rope"](cos, sin) if liger else na,
                           foak=lambda q, k: foak.rope(q, k, cos, sin))),
        dict(op="SwiGLU g,u[16384,14336]", inputs=[g, u], floor=nbytes(g) * 8,
             variants=dict(eager=eager_swiglu, compile=torch.compile(eager_swiglu),
                           liger=liger["swiglu"] if liger else na, foak=foak.swiglu)),
        dict(op="GeGLU tanh g,u[16384,14336]", inputs=[g, u], floor=nbytes(g) * 8,
             variants=dict(eager=eager_geglu, compile=torch.compile(eager_geglu),
                           foak=lambda g, u: foak.geglu(g, u, "tanh"))),
    ]


def run_timings(specs, bandwidth, warmup, reps):
    results = {}
    for run in (1, 2):
        log(f"-- timing pass {run} (median of {reps} after {warmup} warm-up, fwd+bwd, bf16)")
        for spec in specs:
            rows = results.setdefault(spec["op"], {"floor_ms": spec["floor"] / bandwidth * 1e3, "variants": {}})
            for name, fn in spec["variants"].items():
                row = rows["variants"].setdefault(name, {"runs_ms": []})
                if fn is None or "error" in row:
                    row.setdefault("error", "n/a (not importable)")
                    continue
                try:
                    outs = as_tuple(fn(*fresh(spec["inputs"], [])[0]))
                    dys0 = [torch.randn_like(o) for o in outs]
                    del outs
                    ms = cuda_median_ms(lambda ins, dys: timed_fwd_bwd(fn, ins, dys),
                                        lambda: fresh(spec["inputs"], dys0), warmup, reps)
                    row["runs_ms"].append(ms)
                    if run == 1:
                        row["extra_peak_mib"] = extra_peak_mib(fn, spec["inputs"], dys0)
                        row["result"] = timed_fwd_bwd(fn, *fresh(spec["inputs"], dys0))
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    if name == "foak":
                        record(f"foak runs at bench shape: {spec['op']}", {}, 0.0, row["error"])
                log(f"   {spec['op']:<40} {name:<8} " + (f"{row['runs_ms'][-1]:8.3f} ms" if row["runs_ms"] and
                    "error" not in row else row.get("error", "")))
            if run == 1:
                agreement(spec["op"], rows["variants"])
    return results


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
    def version(dist, module=None):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            try:
                return __import__(module or dist).__version__
            except Exception:
                return "n/a"

    h = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu smoke)",
         "torch": torch.__version__, "triton": triton.__version__, "foak": foak.__version__,
         "transformers": version("transformers"), "liger_kernel": version("liger-kernel", "liger_kernel")}
    if not smoke:
        h["copy_bandwidth_GBps"] = copy_bandwidth() / 1e9
    for k, v in h.items():
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
        cells = [fmt(v.get(n)) for n in ("eager", "compile", "liger", "foak")]
        lines.append(f"| {op} | " + " | ".join(cells) + f" | {rows['floor_ms']:.3f} | "
                     + (f"{ratio:.2f}x |" if ratio else "n/a |"))
    lines.append("ms: medians of timing pass 1 / pass 2; MiB: extra peak memory of one fwd+bwd (outputs and "
                 "grads alive); ratio: foak / faster rival, best pass each (<1 means foak is faster).")
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

    log("== correctness: foak vs reference (fp32 vs fp64 ref, bf16 vs fp32 ref of the same bf16 inputs)")
    cap = (lambda n: min(n, 40)) if smoke else (lambda n: n)
    for dtype in (torch.float32, torch.bfloat16):
        for checks in (rms_checks, rope_checks, glu_checks):
            checks(dev, dtype, cap)
    timings = {}
    if not smoke:
        compile_check(dev)
        specs = bench_specs(load_liger())
        timings = run_timings(specs, result["header"]["copy_bandwidth_GBps"] * 1e9, args.warmup, args.reps)
    table = summarise(timings) if timings else []
    failed = [c["name"] for c in CHECKS if not c["passed"]]
    result |= {"checks": CHECKS, "timings": timings, "failed_checks": failed, "table_md": table}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ops_h200.json").write_text(json.dumps(result, indent=1))
    log(f"== {len(CHECKS) - len(failed)}/{len(CHECKS)} checks passed; wrote {out / 'ops_h200.json'}")
    for name in failed:
        log(f"   FAILED: {name}")
    log("\n" + "\n".join(table))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
