"""GPTQ 4-bit GEMM with the dequantization in its inner loop (foak.ops.gptq_matmul) vs dequantize-then-cuBLAS
and vs cuBLAS on the dense bf16 weight, on the H200 (issue [gptq], item 3).

    python benchmarks/gptq_matmul.py               # CUDA: checks, tile sweep, timings; JSON in $OUT (default ./out)
    python benchmarks/gptq_matmul.py --cpu-smoke   # CPU, Triton interpreter, tiny shapes: the checks only

Weights: Llama-3-8B projection shapes ([out, in]: q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down
4096x14336), N(0, 0.02) bf16 quantized by foak's round-to-nearest quantizer (group 128, symmetric), plain
groups and act-order. x: [rows, in] bf16, rows from 1 (decoding) to 8192 (a B2xS4096 training step).
Checks: gptq_matmul in bf16/fp16 no further from an fp32 computation (x and the dequantized weight in fp32)
than cuBLAS's own bf16/fp16 GEMM on the dequantized weight, within 2x + 1e-3 of the output scale; fp32 (IEEE
dot) within 1e-4 relative. Times: each call replayed from a CUDA graph (20 calls, host out of the way) —
``fused`` (gptq_matmul), ``dequant+mm`` (GPTQWeight.dequantize then torch.mm, what gptq_linear does above
TUNING["max_rows"]), ``dense mm`` (torch.mm on the dense bf16 weight: the speed of an unquantized layer).
The sweep picks the fastest tile per row count on two shapes; the table (last) uses the best tile found for
each row count and says which.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import sys
from pathlib import Path

SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from foak.bench.measure import CheckLog, environment, install_interpreter_compat, overridden
from foak.bench.measure import graph_ms  # CUDA-graph per-call time

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
ROWS = [1, 8, 16, 32, 64, 128, 256, 1024, 8192]
SWEEP_ROWS = [1, 16, 64, 256]
SWEEP_SHAPES = [(4096, 4096), (14336, 4096)]
SMOKE_SHAPES = [(40, 136)]
SMOKE_ROWS = [1, 37]
GROUP = 128


def sweep_configs(rows):
    if rows <= 16:
        space = itertools.product((16,), (32, 64, 128), (64, 128, 256), (1, 2, 4, 8))
    elif rows <= 64:
        space = itertools.product((16, 32, 64), (64, 128), (64, 128), (1, 2, 4))
    else:
        space = itertools.product((64, 128), (64, 128), (64, 128), (1, 2))
    return [{"block_m": bm, "block_n": bn, "block_k": bk, "split_k": split, "warps": 4, "stages": 3,
             "by_nibble": by_nibble}
            for bm, bn, bk, split in space for by_nibble in (False, True) if bk >= 128 or not by_nibble]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    if SMOKE:
        install_interpreter_compat()  # bf16 in the interpreter (the tests' layer)
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU checks", file=sys.stderr)
        return 2
    import importlib

    mm_mod = importlib.import_module("foak.ops.gptq_matmul")
    from foak.ops.gptq import GPTQWeight, gptq_quantize_rtn
    from foak.ops.gptq_matmul import gptq_matmul

    device = "cpu" if SMOKE else "cuda"
    default_tuning = dict(mm_mod.TUNING)
    checks, sweep, rows_out = CheckLog(), [], []
    check = checks.check
    with_tuning = functools.partial(overridden, mm_mod.TUNING)  # with_tuning(changes, fn)

    def weights(shape, act_order, seed):
        torch.manual_seed(seed)
        w = (torch.randn(shape, device=device) * 0.02).to(torch.bfloat16)
        return gptq_quantize_rtn(w, GROUP, sym=True, act_order=act_order)

    # 1. checks ----------------------------------------------------------------------------------------
    for shape in (SMOKE_SHAPES if SMOKE else SHAPES[:1] + SHAPES[3:]):
        for act_order in (False, True):
            packed = weights(shape, act_order, 1)
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                weight = GPTQWeight(**packed, dtype=dtype)
                w32 = weight.dequantize(torch.float32)
                for rows in (SMOKE_ROWS if SMOKE else (1, 37, 300)):
                    x = torch.randn(rows, shape[1], device=device).to(dtype)
                    ref = x.float() @ w32.t()
                    ours = (gptq_matmul(x, weight).float() - ref).abs().max().item()
                    theirs = (torch.mm(x, weight.dequantize().t()).float() - ref).abs().max().item()
                    scale = ref.abs().max().item()
                    tag = f"{list(shape)} {'act-order' if act_order else 'plain'} {dtype} rows {rows}"
                    if dtype == torch.float32:
                        check(f"{tag} fp32 within 1e-4 of fp32 reference", ours <= 1e-4 * scale, err=ours,
                              scale=scale)
                    else:
                        check(f"{tag} no further from fp32 than cuBLAS (2x)", ours <= 2 * theirs + 1e-3 * scale,
                              err=ours, cublas_err=theirs)
            del packed

    best = {}  # rows -> tuning
    if not SMOKE and not args.no_sweep:
        # 2. tile sweep ----------------------------------------------------------------------------------
        for rows in SWEEP_ROWS:
            for config in sweep_configs(rows):
                total = 0.0
                for shape in SWEEP_SHAPES:
                    packed = weights(shape, False, 2)
                    weight = GPTQWeight(**packed, dtype=torch.bfloat16)
                    x = torch.randn(rows, shape[1], device=device, dtype=torch.bfloat16)
                    try:
                        ms = with_tuning(config, lambda: graph_ms(lambda: gptq_matmul(x, weight), calls=10, reps=10))
                    except Exception as error:  # out of shared memory / registers for this tile
                        ms = float("inf")
                        print(f"config {config} failed: {type(error).__name__}: {str(error)[:120]}", flush=True)
                    total += ms
                    sweep.append({"rows": rows, "shape": list(shape), **config, "ms": ms})
                print(json.dumps({"rows": rows, **config, "sum_ms": total}), flush=True)
                if total < best.get(rows, ({}, float("inf")))[1]:
                    best[rows] = (config, total)
        best = {rows: cfg for rows, (cfg, _) in best.items()}
        print("best per rows:", json.dumps(best), flush=True)

    def tuning_for(rows):
        if not best:
            return {}
        bucket = min((r for r in best if r >= rows), default=max(best))
        return best[bucket]

    # 3. timings ---------------------------------------------------------------------------------------
    if not SMOKE:
        for shape in SHAPES:
            for act_order in (False, True):
                packed = weights(shape, act_order, 3)
                weight = GPTQWeight(**packed, dtype=torch.bfloat16)
                dense = weight.dequantize()
                for rows in ROWS:
                    x = torch.randn(rows, shape[1], device=device, dtype=torch.bfloat16)
                    tuning = tuning_for(rows)
                    row = {"shape": list(shape), "act_order": act_order, "rows": rows, "tuning": tuning}
                    row["fused_ms"] = with_tuning(tuning, lambda: graph_ms(lambda: gptq_matmul(x, weight)))
                    row["dequant_mm_ms"] = graph_ms(lambda: torch.mm(x, weight.dequantize().t()))
                    row["dense_mm_ms"] = graph_ms(lambda: torch.mm(x, dense.t()))
                    row["fused_over_dequant_mm"] = row["fused_ms"] / row["dequant_mm_ms"]
                    row["weight_GBps_fused"] = packed["qweight"].numel() * 4 / row["fused_ms"] / 1e6
                    rows_out.append(row)
                    print(json.dumps(row), flush=True)
                del packed, weight, dense
                torch.cuda.empty_cache()

    meta = {"environment": environment(init_cuda=not SMOKE), "default_tuning": default_tuning,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("gptq_matmul_cpu_smoke.json" if SMOKE else "gptq_matmul_h200.json")
    path.write_text(json.dumps({**meta, "checks": checks, "best": best, "sweep": sweep, "rows": rows_out}, indent=1))
    print(f"wrote {path}")
    if rows_out:
        print("| shape [out, in] | g_idx | rows | fused ms | dequant+mm ms | dense mm ms | fused / dequant+mm |")
        print("|---|---|---|---|---|---|---|")
        for r in rows_out:
            print(f"| {r['shape']} | {'act-order' if r['act_order'] else 'plain'} | {r['rows']} | {r['fused_ms']:.4f} "
                  f"| {r['dequant_mm_ms']:.4f} | {r['dense_mm_ms']:.4f} | {r['fused_over_dequant_mm']:.2f} |")
    print(checks.summary())
    return 0 if checks.all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
