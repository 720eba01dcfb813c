"""foak's NF4 dequantization vs bitsandbytes' CUDA ``dequantize_4bit`` (issue [lora], QLoRA base weights).

    python benchmarks/nf4.py                      # CUDA: bit-exact checks, then timings; JSON in $OUT (default ./out)
    python benchmarks/nf4.py --cpu-smoke          # CPU, Triton interpreter, tiny shapes: the checks only

Llama-3-8B projection shapes, bf16 weights quantized by bitsandbytes itself (blocksize 64, double-quantized
absmax, as QLoRA loads them). Checks (torch.equal against bitsandbytes' output): foak with the nested scales
computed in the kernel (the default; the launch disables FMA contraction), with the scales computed in torch
first (TUNING["absmax"] = "torch"), foak's torch reference, and once without double quantization.
Times (CUDA-event median of 50 calls after warm-up, host overhead included as a caller sees it):
bitsandbytes ``dequantize_4bit(packed, quant_state)``, ``foak nf4_dequantize`` (validates each call),
``NF4Weight.dequantize`` (validated once, what the LoRA ops call) and the torch-scales variant; GB/s counts
the bytes foak's kernel reads and writes. The table (last) gives bnb_ms / foak_ms.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when foak's kernels are decorated: before the import

import torch

from foak.bench.measure import CheckLog, environment, install_interpreter_compat, overridden
from foak.bench.measure import event_median_ms as timed_ms  # CUDA-event median

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]
SMOKE_SHAPES = [(37, 130), (129, 160)]


def raw_args(qs):
    kw = {"code": qs.code, "blocksize": qs.blocksize}
    if qs.nested:
        kw.update(nested_absmax=qs.state2.absmax, nested_code=qs.state2.code,
                  nested_blocksize=qs.state2.blocksize, offset=qs.offset)
    return qs.absmax, qs.shape, qs.dtype, kw


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes, no timing")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    if SMOKE:
        install_interpreter_compat()  # bf16 in the interpreter (the tests' layer)
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU checks", file=sys.stderr)
        return 2

    import bitsandbytes.functional as bnbf

    from foak.ops import nf4 as nf4_mod
    from foak.ops.nf4 import NF4Weight, nf4_dequantize, nf4_dequantize_reference

    device = "cpu" if SMOKE else "cuda"
    shapes = SMOKE_SHAPES if SMOKE else SHAPES
    checks, rows = CheckLog(), []
    check = checks.check

    def with_absmax_mode(mode, fn):
        return overridden(nf4_mod.TUNING, {"absmax": mode}, fn)

    for i, shape in enumerate(shapes):
        torch.manual_seed(i)
        w = (torch.randn(shape, device=device) * 0.02).to(torch.bfloat16)
        for nested in ((True, False) if i == 0 else (True,)):
            packed, qs = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")
            absmax, shp, dt, kw = raw_args(qs)
            expected = bnbf.dequantize_4bit(packed, qs, quant_type="nf4")
            tag = f"{list(shape)} {'nested' if nested else 'plain'}"
            for mode in ("kernel", "torch"):
                got = with_absmax_mode(mode, lambda: nf4_dequantize(packed, absmax, shp, dt, **kw))
                bad = (got != expected).sum().item()
                check(f"{tag} foak (scales in {mode}) == bnb", bad == 0, mismatches=bad)
            got = nf4_dequantize_reference(packed, absmax, shp, dt, **kw)
            check(f"{tag} foak reference == bnb", torch.equal(got, expected))
            weight = NF4Weight(packed, absmax, shp, dt, **kw)
            check(f"{tag} NF4Weight.dequantize == bnb", torch.equal(weight.dequantize(), expected))
            if SMOKE or not nested:
                continue
            n = expected.numel()
            moved = packed.numel() + absmax.numel() + qs.state2.absmax.numel() * 4 + n * expected.element_size()
            row = {"shape": list(shape), "dtype": "bf16", "nested": nested}
            row["bnb_ms"] = timed_ms(lambda: bnbf.dequantize_4bit(packed, qs, quant_type="nf4"), reps=args.reps,
                                     warmup=10)
            row["foak_ms"] = timed_ms(lambda: nf4_dequantize(packed, absmax, shp, dt, **kw), reps=args.reps,
                                      warmup=10)
            row["foak_weight_ms"] = timed_ms(weight.dequantize, reps=args.reps, warmup=10)
            row["foak_torch_scales_ms"] = with_absmax_mode(
                "torch", lambda: timed_ms(weight.dequantize, reps=args.reps, warmup=10))
            row["foak_GBps"] = moved / row["foak_weight_ms"] / 1e6
            row["ratio_bnb_over_foak"] = row["bnb_ms"] / row["foak_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del packed, qs, expected, weight
        del w
        if not SMOKE:
            torch.cuda.empty_cache()

    meta = {"environment": environment(init_cuda=not SMOKE), "tuning": dict(nf4_mod.TUNING), "reps": args.reps,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("nf4_cpu_smoke.json" if SMOKE else "nf4_h200.json")
    path.write_text(json.dumps({**meta, "checks": checks, "rows": rows}, indent=1))
    print(f"wrote {path}")
    if rows:
        print("| shape (bf16, nested) | bnb ms | foak ms | bnb/foak | NF4Weight.dequantize ms | torch-scales ms "
              "| GB/s |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['shape']} | {r['bnb_ms']:.4f} | {r['foak_ms']:.4f} | {r['ratio_bnb_over_foak']:.2f} "
                  f"| {r['foak_weight_ms']:.4f} | {r['foak_torch_scales_ms']:.4f} | {r['foak_GBps']:.0f} |")
    print(checks.summary())
    return 0 if checks.all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
