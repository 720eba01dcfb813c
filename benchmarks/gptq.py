"""foak's GPTQ 4-bit dequantization on the GPU (issue [gptq]): bit-exact checks, time, bandwidth, dequant + GEMM.

    python benchmarks/gptq.py                      # CUDA: checks, tile sweep, timings; JSON in $OUT (default ./out)
    python benchmarks/gptq.py --tuning '{"block_out": 32}'   # override foak.ops.gptq.TUNING for the timings
    python benchmarks/gptq.py --cpu-smoke          # CPU, Triton interpreter, tiny shapes: the checks only

Llama-3-8B projection shapes ([out, in]: q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down 4096x14336),
bf16 weights N(0, 0.02) quantized by foak's round-to-nearest quantizer (4-bit, group 128, symmetric, "gptq"
v1 zeros), once with plain groups and once with act-order (g_idx permuted by descending column norm).
Checks (torch.equal against foak's torch reference on the same device): gptq_dequantize and
GPTQWeight.dequantize in bf16 and fp16, both unpack variants and both tile layouts, and every tile configuration of the sweep.
Times (CUDA-event median of --reps calls after warm-up, foak.bench.measure.event_median_ms; host
overhead included, as a caller sees it): ``gptq_dequantize`` (validates each call, one host sync for g_idx),
``GPTQWeight.dequantize`` (validated once: what the LoRA ops call), and the kernel alone (20 calls of
GPTQWeight.dequantize replayed from a CUDA graph, per call). Bandwidth counts the bytes the kernel must move
(qweight, qzeros, scales, g_idx read once, the bf16 output written) against a plain ``dst.copy_(src)`` of a
bf16 tensor of the output's size (reads and writes 2 x its bytes), timed the same two ways; the issue's
target is >= 85% of copy bandwidth. ``dequant+mm``: ``torch.mm(x, w.dequantize().t())`` vs
``torch.mm(x, dense.t())`` on the bf16 dense weight, x [--tokens, in] bf16. The sweep times the kernel
(CUDA graph) for a few tile shapes on the gate/up shape; the table (last) uses TUNING as given.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
from pathlib import Path

SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when foak's kernels are decorated: before the import

import torch

from foak.bench.measure import CheckLog, environment, graph_ms, install_interpreter_compat, overridden
from foak.bench.measure import event_median_ms as timed_ms  # CUDA-event median

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
SMOKE_SHAPES = [(40, 136), (72, 264)]
GROUP = 128
SWEEP = [  # (block_out, block_in, warps, unpack, layout); layout applies to plain and act-order alike here
    (64, 128, 4, "reshape", "out_major"), (64, 128, 4, "gather", "out_major"), (32, 128, 4, "reshape", "out_major"),
    (128, 128, 4, "reshape", "out_major"), (128, 128, 8, "reshape", "out_major"), (64, 256, 4, "reshape", "out_major"),
    (64, 256, 8, "reshape", "out_major"), (32, 256, 4, "reshape", "out_major"), (16, 128, 4, "reshape", "out_major"),
    (64, 128, 4, "reshape", "in_major"), (128, 64, 4, "reshape", "in_major"), (128, 128, 4, "reshape", "in_major"),
    (128, 128, 8, "reshape", "in_major"), (256, 64, 4, "reshape", "in_major"), (256, 32, 4, "reshape", "in_major"),
    (64, 64, 4, "reshape", "in_major"), (128, 32, 4, "reshape", "in_major"), (256, 128, 8, "reshape", "in_major"),
]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes, no timing")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=8192, help="rows of x in the dequant+mm timing (B2 x S4096)")
    parser.add_argument("--tuning", default=None, help="JSON dict merged into foak.ops.gptq.TUNING for the timings")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    if SMOKE:
        install_interpreter_compat()  # bf16 in the interpreter (the tests' layer)
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU checks", file=sys.stderr)
        return 2

    from foak.ops import gptq as gptq_mod
    from foak.ops.gptq import (
        GPTQWeight,
        gptq_dequantize,
        gptq_dequantize_reference,
        gptq_error_report,
        gptq_quantize_rtn,
    )

    if args.tuning:
        gptq_mod.TUNING.update(json.loads(args.tuning))
    default_tuning = dict(gptq_mod.TUNING)
    device = "cpu" if SMOKE else "cuda"
    shapes = SMOKE_SHAPES if SMOKE else SHAPES
    checks, rows, sweep = CheckLog(), [], []
    check = checks.check
    with_tuning = functools.partial(overridden, gptq_mod.TUNING)  # with_tuning(changes, fn)

    def mismatches(got, expected):
        return int((got.view(torch.int16) != expected.view(torch.int16)).sum()) if got.shape == expected.shape \
            else -1

    # 1. tile sweep (kernel time only), on the gate/up shape -------------------------------------------
    if not args.no_sweep:
        shape = shapes[-1] if SMOKE else (14336, 4096)
        torch.manual_seed(100)
        w = (torch.randn(shape, device=device) * 0.02).to(torch.bfloat16)
        for act_order in (False, True):
            packed = gptq_quantize_rtn(w, GROUP, sym=True, act_order=act_order)
            weight = GPTQWeight(**packed, dtype=torch.bfloat16)
            expected = gptq_dequantize_reference(**packed, dtype=torch.bfloat16)
            for bo, bi, warps, unpack, layout in (SWEEP[:2] + SWEEP[-1:] if SMOKE else SWEEP):
                tuning = {"block_out": bo, "block_in": bi, "warps": warps, "unpack": unpack, "layout": layout,
                          "act_order_layout": layout, "act_order_block_out": bo, "act_order_block_in": bi}
                got = with_tuning(tuning, weight.dequantize)
                bad = mismatches(got, expected)
                name = f"sweep {list(shape)} {'act-order' if act_order else 'plain'} {tuning}"
                check(f"{name} == reference", bad == 0, mismatches=bad)
                if not SMOKE:
                    ms = with_tuning(tuning, lambda: graph_ms(weight.dequantize))
                    sweep.append({"shape": list(shape), "act_order": act_order, **tuning, "kernel_ms": ms})
                    print(json.dumps(sweep[-1]), flush=True)
            del packed, weight, expected, got
        del w

    # 2. checks and timings per shape --------------------------------------------------------------------
    for n, shape in enumerate(shapes):
        out_f, in_f = shape
        torch.manual_seed(n)
        w = (torch.randn(shape, device=device) * 0.02).to(torch.bfloat16)
        for act_order in (False, True):
            tag = f"{list(shape)} g{GROUP} sym {'act-order' if act_order else 'plain'}"
            packed = gptq_quantize_rtn(w, GROUP, sym=True, act_order=act_order)
            weight = GPTQWeight(**packed, dtype=torch.bfloat16)
            check(f"{tag} GPTQWeight sees act-order" if act_order else f"{tag} GPTQWeight sees group {GROUP}",
                  weight.group_size == (None if act_order else GROUP), group_size=weight.group_size)
            for dtype in (torch.bfloat16, torch.float16):
                expected = gptq_dequantize_reference(**packed, dtype=dtype)
                for unpack, layout in (("reshape", "out_major"), ("gather", "out_major"), ("reshape", "in_major")):
                    variant = {"unpack": unpack, "layout": layout, "act_order_layout": layout,
                               "act_order_block_out": 64, "act_order_block_in": 128}
                    got = with_tuning(variant, lambda: gptq_dequantize(**packed, dtype=dtype))
                    bad = mismatches(got, expected)
                    check(f"{tag} {dtype} gptq_dequantize ({unpack}, {layout}) == reference", bad == 0,
                          mismatches=bad)
                bad = mismatches(weight.dequantize(dtype), expected)
                check(f"{tag} {dtype} GPTQWeight.dequantize == reference", bad == 0, mismatches=bad)
            error = gptq_error_report(w, packed)
            check(f"{tag} RTN relative error < 0.13", error < 0.13, rel_error=round(error, 5))
            if SMOKE:
                continue
            moved = (sum(packed[k].numel() * packed[k].element_size() for k in ("qweight", "qzeros", "scales",
                                                                                "g_idx")) + out_f * in_f * 2)
            src, dst = torch.empty_like(w).normal_(), torch.empty_like(w)
            copy_bytes = 2 * w.numel() * w.element_size()
            row = {"shape": shape, "group_size": GROUP, "sym": True, "act_order": act_order, "rel_error": error,
                   "bytes_moved": moved}
            row["gptq_dequantize_ms"] = timed_ms(lambda: gptq_dequantize(**packed, dtype=torch.bfloat16),
                                                 reps=args.reps, warmup=10)
            row["weight_dequantize_ms"] = timed_ms(weight.dequantize, reps=args.reps, warmup=10)
            row["kernel_ms"] = graph_ms(weight.dequantize)
            row["copy_ms"] = timed_ms(lambda: dst.copy_(src), reps=args.reps, warmup=10)
            row["copy_kernel_ms"] = graph_ms(lambda: dst.copy_(src))
            row["GBps"] = moved / row["weight_dequantize_ms"] / 1e6
            row["copy_GBps"] = copy_bytes / row["copy_ms"] / 1e6
            row["kernel_GBps"] = moved / row["kernel_ms"] / 1e6
            row["copy_kernel_GBps"] = copy_bytes / row["copy_kernel_ms"] / 1e6
            row["pct_of_copy"] = 100 * row["GBps"] / row["copy_GBps"]
            row["kernel_pct_of_copy"] = 100 * row["kernel_GBps"] / row["copy_kernel_GBps"]
            x = torch.randn(args.tokens, in_f, device=device, dtype=torch.bfloat16)
            dense = weight.dequantize()
            row["mm_ms"] = timed_ms(lambda: torch.mm(x, dense.t()), reps=args.reps, warmup=10)
            row["dequant_mm_ms"] = timed_ms(lambda: torch.mm(x, weight.dequantize().t()), reps=args.reps, warmup=10)
            row["dequant_mm_over_mm"] = row["dequant_mm_ms"] / row["mm_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del src, dst, x, dense
            torch.cuda.empty_cache()
            del packed, weight
        del w

    meta = {"environment": environment(init_cuda=not SMOKE), "tuning": default_tuning, "reps": args.reps,
            "tokens": args.tokens,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("gptq_cpu_smoke.json" if SMOKE else "gptq_h200.json")
    path.write_text(json.dumps({**meta, "checks": checks, "sweep": sweep, "rows": rows}, indent=1))
    print(f"wrote {path}")
    if sweep:
        print("| sweep (kernel ms, CUDA graph) | block_out | block_in | warps | unpack | layout | ms |")
        print("|---|---|---|---|---|---|---|")
        for s in sorted(sweep, key=lambda s: (s["act_order"], s["kernel_ms"])):
            print(f"| {s['shape']} {'act-order' if s['act_order'] else 'plain'} | {s['block_out']} | {s['block_in']} "
                  f"| {s['warps']} | {s['unpack']} | {s['layout']} | {s['kernel_ms']:.4f} |")
    if rows:
        print(f"\nTUNING {default_tuning}; x [{args.tokens}, in] bf16 for the GEMMs")
        print("| shape [out, in] | g_idx | gptq_dequantize ms | GPTQWeight.dequantize ms | GB/s | % of copy "
              "| kernel ms | kernel GB/s | kernel % of copy | dequant+mm ms | mm ms | ratio | rel err |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['shape']} | {'act-order' if r['act_order'] else 'plain'} | {r['gptq_dequantize_ms']:.4f} "
                  f"| {r['weight_dequantize_ms']:.4f} | {r['GBps']:.0f} | {r['pct_of_copy']:.0f}% "
                  f"| {r['kernel_ms']:.4f} | {r['kernel_GBps']:.0f} | {r['kernel_pct_of_copy']:.0f}% "
                  f"| {r['dequant_mm_ms']:.3f} | {r['mm_ms']:.3f} | {r['dequant_mm_over_mm']:.3f} "
                  f"| {r['rel_error']:.4f} |")
    print(checks.summary())
    return 0 if checks.all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
