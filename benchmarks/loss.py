#!/usr/bin/env python3
"""Correctness checks and fwd+bwd timings of foak's cross-entropy (CE) and linear+cross-entropy (LCE) losses
against their references, transformers' ForCausalLMLoss, torch eager, torch.compile and Liger, at the shapes of
/work/shared/ANCHORS.md. Timing and memory helpers come from benchmarks/ops.py.

    python3 benchmarks/loss.py --out DIR                                  # on a CUDA GPU: everything
    TRITON_INTERPRET=1 python3 benchmarks/loss.py --cpu-smoke --out DIR   # CPU: the checks, tiny shapes

Writes DIR/loss_h200.json and prints a markdown table last; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from ops import (
    CHECKS,
    MiB,
    agreement,
    as_tuple,
    cuda_median_ms,
    fwd_bwd,
    header,
    log,
    nbytes,
    phase,
    record,
    rel_err,
    time_variant,
)

from foak.ops.cross_entropy import cross_entropy, cross_entropy_reference
from foak.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # vs an fp32 reference of the same input values
IGN = -100


def err_msg(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def free():
    gc.collect()
    torch.cuda.empty_cache()


def make_target(n, v, dev, frac=1 / 7, ignore_index=IGN, shape=None):
    """Random classes with round(n * frac) rows set to ignore_index at random positions."""
    t = torch.randint(0, v, (n,))
    t[torch.randperm(n)[:round(n * frac)]] = ignore_index
    return t.view(shape or (n,)).to(dev)


# 1. correctness -----------------------------------------------------------------------------------
def loss_check(label, dtype, fn, ref_fn, inputs: dict, dy="randn") -> None:
    """fn / ref_fn(*inputs) -> loss or (loss, z_loss). ref_fn runs on fp32 copies of the same values. Compares
    the loss, z_loss and the gradient of every input that requires grad (upstream grad: random, or ones to
    hit the "incoming grad is 1" path); output dtypes/shapes must match ref_fn's at the native dtype and the
    inputs must be left unchanged."""
    values = list(inputs.values())
    wrt = {n: t for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    snapshot = {n: t.detach().clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)}

    def up(t):
        ok = isinstance(t, torch.Tensor) and t.is_floating_point()
        return t.detach().float().requires_grad_(t.requires_grad) if ok else t

    label, tol = f"{label} {str(dtype).removeprefix('torch.')}", TOL[dtype]
    try:
        with torch.no_grad():
            native = as_tuple(ref_fn(*values))
        outs = as_tuple(fn(*values))
        ref_ins = [up(t) for t in values]
        refs = as_tuple(ref_fn(*ref_ins))
        g = torch.randn_like(refs[0]) if dy == "randn" else torch.ones_like(refs[0])
        grads = torch.autograd.grad(outs[0], list(wrt.values()), g.to(outs[0].dtype))
        ref_grads = torch.autograd.grad(refs[0], [t for t in ref_ins if isinstance(t, torch.Tensor)
                                                  and t.requires_grad], g)
    except Exception as e:  # a crash is a failed check, not a crashed benchmark
        record(label, {}, tol, err_msg(e))
        return
    errs = {"loss": rel_err(outs[0], refs[0])}
    if len(refs) > 1:
        errs["z_loss"] = rel_err(outs[1], refs[1]) if len(outs) > 1 else float("nan")
    errs |= {f"d{n}": rel_err(gr, r) for n, gr, r in zip(wrt, grads, ref_grads)}
    problems = [f"out{i} is {a.dtype}{tuple(a.shape)}, expected {b.dtype}{tuple(b.shape)}"
                for i, (a, b) in enumerate(zip(outs, native)) if (a.dtype, a.shape) != (b.dtype, b.shape)]
    problems += [f"{len(outs)} outputs, expected {len(native)}"] if len(outs) != len(native) else []
    problems += [f"input {n} was modified" for n, t in snapshot.items() if not torch.equal(inputs[n], t)]
    record(label, errs, tol, "; ".join(problems) or None)


ALL = dict(label_smoothing=0.1, lse_square_scale=1e-4, return_z_loss=True, softcap=30.0, logits_scaling=8.0)


def ce_checks(dev, dtype, shapes):
    def case(N, V, tag, scale=2.0, dy="randn", ignore=IGN, frac=1 / 7, pad=0, inplace=False, **kw):
        x = (torch.randn(N, V + pad, device=dev) * scale).to(dtype).requires_grad_()
        t = make_target(N, V, dev, frac, ignore)
        view = (lambda x: x[:, :V]) if pad else (lambda x: x.clone()) if inplace else (lambda x: x)

        def body(op, **more):
            return lambda x: op(view(x), t, ignore_index=ignore, **kw, **more)

        foak = body(cross_entropy, inplace_backward=True) if inplace else body(cross_entropy)
        loss_check(f"CE [{N},{V}] {tag}", dtype, foak, body(cross_entropy_reference), {"logits": x}, dy)

    (N, V), (N2, V2) = shapes
    case(N, V, "mean")
    case(N, V, "mean, upstream grad 1", dy="ones")
    case(N, V, "label_smoothing 0.1", label_smoothing=0.1)
    case(N, V, "z-loss 1e-4 +return_z_loss", lse_square_scale=1e-4, return_z_loss=True)
    case(N, V, "softcap 30 (logits std 40)", scale=40.0, softcap=30.0)
    case(N, V, "logits_scaling 8 (std 16)", scale=16.0, logits_scaling=8.0)
    case(N, V, "num_items_in_batch int", num_items_in_batch=2 * N // 3)
    case(N, V, "num_items_in_batch tensor", num_items_in_batch=torch.tensor(2 * N // 3, device=dev))
    case(N, V, "reduction none", reduction="none")
    case(N, V, "reduction sum", reduction="sum")
    case(N, V, "all options, reduction none", scale=20.0, reduction="none", **ALL)
    case(N, V, "all options, mean, grad 1", scale=20.0, dy="ones", num_items_in_batch=N // 2, **ALL)
    case(N, V, "ignore_index -1", ignore=-1)
    case(N, V, "all rows ignored", frac=1.0)
    case(N, V, "large logits (std 100)", scale=100.0)
    case(N, V, "inplace_backward", inplace=True)
    case(N, V, "inplace_backward, reduction none", inplace=True, reduction="none")
    case(N, V, "strided rows x[:, :V] of [N, V+5]", pad=5)
    case(N2, V2, "mean")
    case(N2, V2, "mean, upstream grad 1, inplace_backward", dy="ones", inplace=True)
    case(N2, V2, "all options, reduction none", scale=20.0, reduction="none", **ALL)


def lce_checks(dev, dtype, N, H, V):
    def case(tag, bias=False, shift=False, dy="randn", scale=2.0, frac=1 / 7, **kw):
        shape = (2, N // 2, H) if shift else (N, H)
        inputs = {"hidden": torch.randn(*shape, device=dev).to(dtype).requires_grad_(),
                  "weight": (torch.randn(V, H, device=dev) * scale / H**0.5).to(dtype).requires_grad_()}
        if bias:
            inputs["bias"] = (torch.randn(V, device=dev) * 0.5).to(dtype).requires_grad_()
        t = make_target(shape[0] * shape[1] if shift else N, V, dev, frac, shape=shape[:-1])

        def body(op):
            return lambda h, w, b=None: op(h, w, t, b, shift=shift, **kw)

        loss_check(f"LCE h{list(shape)} W[{V},{H}] {tag}", dtype, body(linear_cross_entropy),
                   body(linear_cross_entropy_reference), inputs, dy)

    case("mean")
    case("mean +bias, upstream grad 1", bias=True, dy="ones")
    case("label_smoothing 0.1", label_smoothing=0.1)
    case("z-loss 1e-4 +return_z_loss", lse_square_scale=1e-4, return_z_loss=True)
    case("softcap 30 (logits std 40)", scale=40.0, softcap=30.0)
    case("logits_scaling 8 (std 16)", scale=16.0, logits_scaling=8.0)
    case("num_items_in_batch tensor", num_items_in_batch=torch.tensor(2 * N // 3, device=dev))
    case("reduction none +bias", bias=True, reduction="none")
    case("reduction sum", reduction="sum")
    case("all options +bias, reduction none", bias=True, scale=20.0, reduction="none", **ALL)
    case("shift=True", shift=True)
    case("shift=True, num_items_in_batch int, grad 1", shift=True, dy="ones", num_items_in_batch=N // 2)
    case("all rows ignored", frac=1.0)


def hf_checks(dev, dtype, B, S, H, V):
    """foak LCE(shift=True) == transformers' ForCausalLMLoss(hidden @ W.T, labels) (fp32 copies for the latter)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    labels = make_target(B * S, V, dev, shape=(B, S))
    labels[1, : S // 4] = IGN  # left padding
    for n_items in (None, torch.tensor(int((labels[:, 1:] != IGN).sum()) + 7, device=dev)):
        h = torch.randn(B, S, H, device=dev).to(dtype).requires_grad_()
        w = (torch.randn(V, H, device=dev) * 2 / H**0.5).to(dtype).requires_grad_()
        loss_check(f"LCE shift=True == HF ForCausalLMLoss h[{B},{S},{H}] W[{V},{H}] num_items="
                   f"{None if n_items is None else int(n_items)}", dtype,
                   lambda h, w, n=n_items: linear_cross_entropy(h, w, labels, shift=True, num_items_in_batch=n),
                   lambda h, w, n=n_items: ForCausalLMLoss(h @ w.t(), labels, vocab_size=V, num_items_in_batch=n),
                   {"hidden": h, "weight": w})


def compile_check(dev):
    """torch.compile(fullgraph=True) of one function calling both losses == eager foak (bf16)."""
    N, B, S, H, V = 300, 2, 150, 512, 32003
    t, labels = make_target(N, V, dev), make_target(B * S, V, dev, shape=(B, S))

    def block(logits, hidden, weight):
        a = cross_entropy(logits * 2.0, t, label_smoothing=0.1, softcap=30.0)
        b = cross_entropy(logits, t, reduction="none")
        c = linear_cross_entropy(hidden, weight, labels, shift=True, lse_square_scale=1e-4)
        return a, b, c

    inputs = [(torch.randn(N, V, device=dev) * 4).bfloat16().requires_grad_(),
              torch.randn(B, S, H, device=dev, dtype=torch.bfloat16, requires_grad=True),
              (torch.randn(V, H, device=dev) / H**0.5).bfloat16().requires_grad_()]
    name = "torch.compile(fullgraph) cross_entropy x2 + linear_cross_entropy == eager bf16"
    try:
        outs, grads, dys = fwd_bwd(block, inputs)
        c_outs, c_grads, _ = fwd_bwd(torch.compile(block, fullgraph=True), inputs, dys)
    except Exception as e:
        record(name, {}, 1e-3, err_msg(e))
        return
    errs = {f"out{i}": rel_err(c, o) for i, (c, o) in enumerate(zip(c_outs, outs))}
    errs |= {f"d{n}": rel_err(c, g) for n, c, g in zip(["logits", "hidden", "weight"], c_grads, grads)}
    record(name, errs, 1e-3)


# 2. timing ----------------------------------------------------------------------------------------
def gemm_tflops(n=8192) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    ms = cuda_median_ms(lambda: torch.matmul(a, b, out=c), warmup=5, reps=20)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def load_liger():
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction as CE
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as LCE
    except Exception as e:
        log(f"liger-kernel not importable ({err_msg(e)}); its rows are n/a")
        return None, None
    # apply(_input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
    #       return_z_loss, return_token_accuracy, return_predicted_tokens) -> (loss, z_loss, acc, pred)
    ce = lambda x, t: CE.apply(x, t, None, IGN, 0.0, 0.0, "mean", None, False, False, False)[0]
    # apply(_input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
    #       softcap, return_z_loss, accum_dtype, ...) -> (loss, ...); the rest left at their defaults, as in
    # liger's LigerFusedLinearCrossEntropyLoss module (accum_dtype None: grads accumulate in bf16)
    lce = lambda h, w, t: LCE.apply(h, w, t, None, None, IGN, 0.0, 0.0, "mean", None, False, None)[0]
    return ce, lce


def bench_specs(gemm_rate, bandwidth, warmup, reps, N=8192, H=4096, V=128256, dev="cuda"):
    """One entry per op: inputs (Parameters are not cloned), variants, floor, warm-up/reps; upstream grad 1."""
    bf16 = torch.bfloat16
    liger_ce, liger_lce = load_liger()
    t = make_target(N, V, dev)
    logits = torch.randn(N, V, device=dev, dtype=bf16, requires_grad=True)
    hidden = torch.randn(N, H, device=dev, dtype=bf16, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(V, H, device=dev, dtype=bf16) / H**0.5)

    def eager_ce(x):  # what HF does: upcast, then F.cross_entropy
        return F.cross_entropy(x.float(), t, ignore_index=IGN)

    def eager_lce(h, w):
        return F.cross_entropy((h @ w.t()).float(), t, ignore_index=IGN)

    one = [torch.ones((), device=dev)]
    flops = 3 * 2 * N * V * H
    valid = int((t != IGN).sum())
    return [
        dict(op=f"cross-entropy logits[{N},{V}], 1/7 ignored", inputs=[logits], dys=one, warmup=warmup, reps=reps,
             floor_ms=2 * nbytes(logits) / bandwidth * 1e3, floor_note="(read logits + write grad) / copy bw",
             variants=dict(eager=eager_ce, compile=torch.compile(eager_ce),
                           liger=liger_ce and (lambda x: liger_ce(x, t)),
                           foak=lambda x: cross_entropy(x, t),
                           foak_inplace=lambda x: cross_entropy(x, t, inplace_backward=True))),
        dict(op=f"linear+CE h[{N},{H}] W[{V},{H}], 1/7 ignored", inputs=[hidden, weight], dys=one, warmup=3,
             reps=10, floor_ms=flops / gemm_rate * 1e3, floor_valid_rows_ms=flops * valid / N / gemm_rate * 1e3,
             floor_note="3 GEMMs of 2*N*V*H FLOPs / measured bf16 GEMM rate (second: non-ignored rows only)",
             variants=dict(eager=eager_lce, compile=torch.compile(eager_lce),
                           liger=liger_lce and (lambda h, w: liger_lce(h, w, t)),
                           foak=lambda h, w: linear_cross_entropy(h, w, t))),
    ]


def tracking(fn, seen: list):
    """fn, remembering the storages of its last call's inputs (to tell new gradients from in-place ones)."""
    def call(*ins):
        seen[:] = [x.untyped_storage().data_ptr() for x in ins]
        return fn(*ins)
    return call


def run_timings(specs):
    results = {}
    for run in (1, 2):
        for spec in specs:
            log(f"-- timing pass {run}: {spec['op']} (median of {spec['reps']} after {spec['warmup']} warm-up, "
                "fwd+bwd, bf16, upstream grad 1)")
            rows = results.setdefault(spec["op"], {k: v for k, v in spec.items() if k.startswith("floor")}
                                      | {"variants": {}})
            for name, fn in spec["variants"].items():
                row = rows["variants"].setdefault(name, {"runs_ms": []})
                if fn is None:
                    row["error"] = "n/a (not importable)"
                if "error" in row:
                    continue
                seen = []
                try:
                    time_variant(spec, tracking(fn, seen), row, run == 1, spec["warmup"], spec["reps"])
                    if run == 1:  # the gradients that live in new memory (not in an input's storage)
                        grads = row["result"][1]
                        new = sum(nbytes(g) for g, p in zip(grads, seen) if g.untyped_storage().data_ptr() != p)
                        row["new_grad_mib"] = new / MiB
                        row["extra_peak_beyond_grads_mib"] = row["extra_peak_mib"] - new / MiB
                    log(f"   {name:<13} {row['runs_ms'][-1]:8.3f} ms" + (
                        f"  extra peak {row['extra_peak_mib']:.0f} MiB, beyond grads "
                        f"{row['extra_peak_beyond_grads_mib']:.0f} MiB" if run == 1 else ""))
                except Exception as e:
                    row.pop("result", None)
                    row["error"] = err_msg(e)
                    log(f"   {name:<13} {row['error']}")
                    if name.startswith("foak"):
                        record(f"{name} runs at bench shape: {spec['op']}", {}, 0.0, row["error"])
                free()
            if run == 1:
                agreement(spec["op"], rows["variants"])  # records "foak == HF eager" (tol 2e-2)
                inplace = rows["variants"].get("foak_inplace", {})
                if "max_rel_err_vs_eager" in inplace:
                    record(f"foak_inplace == HF eager at bench shape: {spec['op']}",
                           {"max": inplace["max_rel_err_vs_eager"]}, 2e-2)
                free()
    return results


# 3. report ----------------------------------------------------------------------------------------
def fmt(row):
    if row is None:
        return "—"
    if "error" in row or not row["runs_ms"]:
        return "n/a"
    return " / ".join(f"{t:.2f}" for t in row["runs_ms"]) + \
        f" ({row.get('extra_peak_mib', float('nan')):.0f} / {row.get('extra_peak_beyond_grads_mib', float('nan')):.0f})"


def summarise(timings) -> list[str]:
    lines = [("| op | eager ms (MiB / MiB beyond grads) | compile | liger | foak | floor ms | "
              "foak vs best of compile/liger |"), "|---|---|---|---|---|---|---|"]
    for op, rows in timings.items():
        v = rows["variants"]
        best = {n: min(r["runs_ms"]) for n, r in v.items() if r["runs_ms"] and "error" not in r}
        rivals = [best[n] for n in ("compile", "liger") if n in best]
        floor = f"{rows['floor_ms']:.2f}" + (f" ({rows['floor_valid_rows_ms']:.2f} non-ignored rows)"
                                              if "floor_valid_rows_ms" in rows else "")
        for foak_name in [n for n in v if n.startswith("foak")]:
            ratio = best[foak_name] / min(rivals) if foak_name in best and rivals else None
            rows[f"{foak_name}_ratio_vs_best_compile_liger"] = ratio
            rows[f"{foak_name}_ratio_vs"] = {n: best[foak_name] / t for n, t in best.items()
                                             if foak_name in best and not n.startswith("foak")}
            first = foak_name == "foak"
            cells = [fmt(v.get(n)) if first else "″" for n in ("eager", "compile", "liger")] + [fmt(v[foak_name])]
            label = op if first else f"↳ {foak_name} (inplace_backward=True)"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {floor if first else '″'} | "
                         + (f"{ratio:.2f}x |" if ratio else "n/a |"))
    lines.append("ms: GPU time, medians of timing pass 1 / pass 2 (host launch overhead hidden by a spin kernel); "
                 "MiB: extra peak memory of one fwd+bwd over the inputs (outputs and grads alive) / the same less "
                 "the gradients held in new memory (an in-place gradient costs nothing extra); ratio: foak / faster "
                 "of compile and liger, best pass each (<1: foak is faster).")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results", help="directory for loss_h200.json")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="CPU only (set TRITON_INTERPRET=1): correctness checks at tiny shapes, no timing")
    parser.add_argument("--warmup", type=int, default=10, help="CE warm-up calls (LCE: 3)")
    parser.add_argument("--reps", type=int, default=30, help="CE timed calls (LCE: 10)")
    args = parser.parse_args()
    smoke = args.cpu_smoke
    if smoke and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        parser.error("--cpu-smoke needs TRITON_INTERPRET=1 (else foak runs its torch reference on CPU)")
    if not smoke and not torch.cuda.is_available():
        parser.error("no CUDA device; use --cpu-smoke with TRITON_INTERPRET=1")
    dev = "cpu" if smoke else "cuda"
    torch.manual_seed(0)
    hdr = header(smoke)  # its environment has the Python version
    if not smoke:
        hdr["gemm_bf16_8192_TFLOPs"] = gemm_tflops()
        log(f"{'gemm_bf16_8192_TFLOPs':>20}: {hdr['gemm_bf16_8192_TFLOPs']:.1f}")
    result = {"header": hdr}

    phase("correctness: foak vs reference (fp32: tol 1e-4; bf16: tol 2e-2 vs fp32 reference of the same values)")
    for dtype in (torch.float32, torch.bfloat16):
        if smoke:
            ce_checks(dev, dtype, [(37, 1003), (5, 5000)])
            lce_checks(dev, dtype, 38, 48, 1003)
            hf_checks(dev, dtype, 2, 17, 48, 1003)
        else:
            ce_checks(dev, dtype, [(1000, 32003), (257, 128256)])
            lce_checks(dev, dtype, 1000, 1000, 32003)
            hf_checks(dev, dtype, 2, 513, 1024, 32003)
            free()
    timings = {}
    if not smoke:
        phase("torch.compile check")
        compile_check(dev)
        free()
        phase("timings")
        try:
            specs = bench_specs(hdr["gemm_bf16_8192_TFLOPs"] * 1e12, hdr["copy_bandwidth_GBps"] * 1e9,
                                args.warmup, args.reps)
            timings = run_timings(specs)
            del specs
        except Exception as e:  # keep the checks' results
            record("timing section ran", {}, 0.0, err_msg(e))
        free()
    table = summarise(timings) if timings else []
    failed = [c["name"] for c in CHECKS if not c["passed"]]
    result |= {"checks": CHECKS, "timings": timings, "failed_checks": failed, "table_md": table}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss_h200.json").write_text(json.dumps(result, indent=1, default=str))
    phase(f"{len(CHECKS) - len(failed)}/{len(CHECKS)} checks passed; wrote {out / 'loss_h200.json'}")
    for name in failed:
        log(f"   FAILED: {name}")
    log("\n" + "\n".join(table or ["(no timings with --cpu-smoke)"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
