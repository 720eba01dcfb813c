"""Attention for packed batches (issue [packing]): the candidate kernels fwd+bwd at Llama-1B and Llama-8B
attention shapes, on the same packed sequences, against what transformers runs today and the same tokens
unpacked.

    PYTHONPATH=src python benchmarks/packing.py [--out DIR] [--reps N] [--shapes 1b 8b 1b-flat] [--window W] [--tag T]  # CUDA
    PYTHONPATH=src python benchmarks/packing.py --cpu-smoke                                         # CPU, tiny shapes

Shapes (bf16): ``1b`` Hq=32, Hkv=8, D=64, 4 rows x 4096; ``8b`` Hq=32, Hkv=8, D=128, 2 rows x 4096 (the
train_step.py rows); each row packs sequences of seq/16 .. seq/2 tokens (train_step.py's packed_inputs
distribution, seeded); ``1b-flat``: the same sequences as ``1b`` in one row of 16384 (padding-free
collators: TRL, foak train --packing; q/k/v reach the varlen kernels as strided views, not copies).
``--window W`` adds each shape again with a sliding window of W tokens.

Candidates (q/k/v as transformers' attention receives them, [B, H, S, D], K/V with Hkv heads):
- ``hf_dense``: what transformers does now for a packed batch: a [B, 1, S, S] block-causal bool mask (built
  once per step for all layers; its build time is ``mask_ms``), K/V repeated to Hq heads (repeat_kv), SDPA
  with the mask (the efficient kernel or math; no flash).
- ``unpacked``: the same tokens as B unpacked rows: SDPA is_causal with enable_gqa (the target speed).
- ``flash``: foak's varlen_attention backend: aten._flash_attention_forward/backward with cu_seqlens, GQA
  and the window inside the kernel (foak's autograd glue).
- ``varlen_attn``: torch.nn.attention.varlen.varlen_attn (same kernel, torch's public wrapper).
- ``flex``: compiled FlexAttention, document-causal block mask (built once per batch: ``mask_ms``), enable_gqa.
- ``sdpa_loop``: SDPA per sequence (is_causal, enable_gqa).
- ``cudnn``: aten._cudnn_attention_forward/backward with cumulative sequence lengths (ragged), GQA native if
  the kernel takes it.
Each: CUDA-event median of --reps fwd+bwd calls after warm-up (``ms``), the first call's wall time
(``first_s``: compilation), the peak allocated during one call minus before it (``extra_MiB``), and the
relative max error of the output and of dq/dk/dv against explicit fp32 math (``err``; a candidate over 2e-2 is
marked FAIL). The layout change foak's attention function does ([B, H, S, D] -> [T, H, D]) is inside the timed
call for the varlen candidates.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from foak.bench.measure import environment, event_median_ms, peak_extra_mib
from foak.ops import varlen_attention as va

SHAPES = {"1b": dict(Hq=32, Hkv=8, D=64, B=4, S=4096), "8b": dict(Hq=32, Hkv=8, D=128, B=2, S=4096),
          # the 1b rows' sequences in one row, as padding-free collators (TRL, foak train --packing) give them
          "1b-flat": dict(Hq=32, Hkv=8, D=64, B=1, S=16384, rows=4)}
SMOKE_SHAPES = {"tiny": dict(Hq=4, Hkv=2, D=16, B=2, S=64), "tiny-flat": dict(Hq=4, Hkv=2, D=16, B=1, S=128, rows=2)}
CANDIDATES = ("hf_dense", "unpacked", "flash", "varlen_attn", "flex", "sdpa_loop", "cudnn")
TOLERANCE = 2e-2


def packed_lengths(B: int, S: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        lengths, start = [], 0
        while start < S:
            n = min(S - start, int(torch.randint(max(S // 16, 1), S // 2 + 1, (1,), generator=g)))
            lengths.append(n)
            start += n
        rows.append(lengths)
    return rows


def dense_block_causal_mask(seqs: va.PackedSequences, window, device) -> torch.Tensor:
    """transformers' packed sdpa mask: [B, 1, S, S] bool, causal within each sequence (and window)."""
    doc = seqs.document_ids().to(device).view(seqs.batch, seqs.seq_len)
    i = torch.arange(seqs.seq_len, device=device)
    keep = (doc[:, :, None] == doc[:, None, :]) & (i[:, None] >= i[None, :])
    if window is not None:
        keep &= i[:, None] - i[None, :] < window
    return keep[:, None]


class _CudnnVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_seqlen, scale):
        res = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_seqlen, max_seqlen, True, 0.0, True,
                                                      False, scale=scale)
        out, lse, seed, offset = res[0], res[1], res[6], res[7]
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        # (grad_out, q, k, v, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q,
        # max_k, dropout_p, is_causal, *, scale): aten's schema (torch 2.13's varlen.py calls it otherwise, on a
        # path it never takes)
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            dout.contiguous(), q, k, v, out, lse, seed, offset, None, cu, cu, ctx.max_seqlen, ctx.max_seqlen, 0.0,
            True, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def make_candidate(name: str, seqs: va.PackedSequences, window, scale: float, device):
    """(fn(q, k, v) -> out [B, S, Hq, D], note) for one candidate; fn raises if it cannot run here."""
    B, S = seqs.batch, seqs.seq_len

    def flat(t):
        return t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[3])

    if name == "hf_dense":
        mask = dense_block_causal_mask(seqs, window, device)

        def fn(q, k, v):
            group = q.shape[1] // k.shape[1]
            kr = k[:, :, None].expand(B, k.shape[1], group, S, k.shape[3]).reshape(B, q.shape[1], S, k.shape[3])
            vr = v[:, :, None].expand(B, v.shape[1], group, S, v.shape[3]).reshape(B, q.shape[1], S, v.shape[3])
            return F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=scale).transpose(1, 2)
        return fn, "dense [B,1,S,S] mask, repeat_kv"
    if name == "unpacked":
        if window is not None and window < S:
            i = torch.arange(S, device=device)
            band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
            return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=scale,
                                                                   enable_gqa=True).transpose(1, 2)), \
                "B unpacked rows, band mask (not the same attention pattern)"
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                               enable_gqa=True).transpose(1, 2)), \
            "B unpacked rows of S (not the same attention pattern)"
    if name == "cudnn":
        if window is not None and window < seqs.max_seqlen:
            raise ValueError("cuDNN's ragged attention takes no sliding window")
        if device.type != "cuda":
            raise ValueError("cuDNN needs CUDA")

        def fn(q, k, v):
            out = _CudnnVarlen.apply(flat(q), flat(k), flat(v), seqs.cu_seqlens, seqs.max_seqlen, scale)
            return out.reshape(B, S, q.shape[1], q.shape[3])
        return fn, "aten._cudnn_attention_* with cum_seq"
    backend = {"flash": "flash", "varlen_attn": "varlen_attn", "flex": "flex", "sdpa_loop": "sdpa"}[name]

    def fn(q, k, v):
        out = va.varlen_attention(flat(q), flat(k), flat(v), seqs, scale=scale, window=window, backend=backend)
        return out.reshape(B, S, q.shape[1], q.shape[3])
    return fn, f"foak varlen_attention backend={backend!r}"


def reference(q, k, v, seqs, window, scale):
    """fp32 explicit math, [B, S, Hq, D], with gradients for a given dout (computed on demand)."""
    B, S = seqs.batch, seqs.seq_len
    flat = lambda t: t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[3])  # noqa: E731
    out = va.varlen_attention_reference(flat(q), flat(k), flat(v), seqs, scale=scale, window=window)
    return out.reshape(B, S, q.shape[1], q.shape[3])


def rel_max_error(a, b) -> float:
    a, b = a.float(), b.float()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def measure(name, seqs, window, shape, dtype, device, reps, ref):
    B, S, Hq, Hkv, D = shape["B"], shape["S"], shape["Hq"], shape["Hkv"], shape["D"]
    scale = 1.0 / math.sqrt(D)
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(B, Hq, S, D, device=device, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(B, Hkv, S, D, device=device, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(B, Hkv, S, D, device=device, dtype=dtype, generator=g).requires_grad_()
    dout = torch.randn(B, S, Hq, D, device=device, dtype=dtype, generator=g)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    row = {"candidate": name}
    try:
        start = time.perf_counter()
        fn, note = make_candidate(name, seqs, window, scale, device)
        sync()
        row["note"] = note
        if name == "hf_dense":
            row["mask_ms"] = (time.perf_counter() - start) * 1e3

        def call():
            for t in (q, k, v):
                t.grad = None
            out = fn(q, k, v)
            out.backward(dout)
            return out

        start = time.perf_counter()
        out = call()
        sync()
        row["first_s"] = time.perf_counter() - start
        if name == "flex":
            row["mask_ms"] = None  # the block mask is built inside the first call, once per batch
        if name != "unpacked":  # unpacked rows compute another attention pattern
            errors = [rel_max_error(a, b) for a, b in zip((out.detach(), q.grad, k.grad, v.grad), ref(q, k, v, dout))]
            row["err"] = dict(zip(("out", "dq", "dk", "dv"), errors))
            row["check"] = "ok" if max(errors) <= (TOLERANCE if dtype != torch.float32 else 1e-4) else "FAIL"
        del out
        for t in (q, k, v):
            t.grad = None
        if device.type == "cuda":
            row["extra_MiB"] = peak_extra_mib(call, device)[0]  # incl. the grads it leaves
            row["ms"] = event_median_ms(call, reps=reps, warmup=2)
        else:
            start = time.perf_counter()
            call()
            row["ms"] = (time.perf_counter() - start) * 1e3
    except Exception as err:  # a candidate that cannot run here is a row with its reason
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        if name == "flex" and device.type == "cpu":  # no backward on the CPU: check its document mask forward-only
            with torch.no_grad():
                out = make_candidate(name, seqs, window, scale, device)[0](q.detach(), k.detach(), v.detach())
            row["forward_only_err"] = rel_max_error(out, ref(q, k, v, dout)[0])
            row["check"] = "ok" if row["forward_only_err"] <= 1e-4 else "FAIL"
    return row


def run_shape(shape_name, shape, window, dtype, device, reps, candidates):
    n_rows = shape.get("rows", shape["B"])  # a flat shape: the sequences of that many rows, in one
    rows_lengths = packed_lengths(n_rows, shape["B"] * shape["S"] // n_rows)
    lengths = [n for row in rows_lengths for n in row]
    seqs = va.sequences_from_lengths(lengths, device=device, batch=shape["B"])
    scale = 1.0 / math.sqrt(shape["D"])
    cache = {}

    def ref(q, k, v, dout):
        if "grads" not in cache:  # fp32 explicit math once per shape (the inputs are the same for every candidate)
            leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
            out = reference(*leaves, seqs, window, scale)
            out.backward(dout.float())
            cache["grads"] = (out.detach(), *(t.grad for t in leaves))
        return cache["grads"]

    rows = []
    for name in candidates:
        row = measure(name, seqs, window, shape, dtype, device, reps, ref)
        row.update(shape=shape_name, window=window, sequences=len(lengths), max_seqlen=seqs.max_seqlen,
                   **{k: v for k, v in shape.items() if k != "rows"})
        rows.append(row)
        print(json.dumps(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--window", type=int, default=None, help="also each shape with this sliding window")
    parser.add_argument("--candidates", nargs="*", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny fp32 shapes: the code paths and checks")
    parser.add_argument("--tag", default="", help="suffix of the result file name (packing_h200[_TAG].json)")
    args = parser.parse_args()
    if args.cpu_smoke:
        device, dtype, shapes, window = torch.device("cpu"), torch.float32, SMOKE_SHAPES, args.window or 7
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: use --cpu-smoke")
        device, dtype, shapes, window = torch.device("cuda"), torch.bfloat16, {s: SHAPES[s] for s in args.shapes}, \
            args.window
    rows = []
    for name, shape in shapes.items():
        rows += run_shape(name, shape, None, dtype, device, args.reps, args.candidates)
        if window is not None:
            rows += run_shape(name, shape, window, dtype, device, args.reps, args.candidates)
    result = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "environment": environment(init_cuda=device.type == "cuda"), "dtype": str(dtype),
              "reps": args.reps, "rows": rows}
    if not args.cpu_smoke:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / f"packing_h200{'_' + args.tag if args.tag else ''}.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    print("| shape | window | candidate | ms fwd+bwd | extra MiB | first s | max rel err | check / error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            checked = (f" (forward-only check: {r['forward_only_err']:.1e} {r['check']})"
                       if "forward_only_err" in r else "")
            print(f"| {r['shape']} | {r['window']} | {r['candidate']} | | | | | {r['error'][:100]}{checked} |")
            continue
        err = max(r["err"].values()) if "err" in r else float("nan")
        extra = f"{r['extra_MiB']:.0f}" if "extra_MiB" in r else ""
        print(f"| {r['shape']} | {r['window']} | {r['candidate']} | {r['ms']:.2f} | {extra} | {r['first_s']:.2f} | "
              f"{err:.2e} | {r.get('check', 'n/a')} |")
    failed = [r for r in rows if r.get("check") == "FAIL"]
    if args.cpu_smoke:
        ran = {r["candidate"] for r in rows if "error" not in r}
        missing = {"hf_dense", "unpacked", "sdpa_loop"} - ran
        if not all(r.get("check") == "ok" for r in rows if r["candidate"] == "flex"):
            missing.add("flex (forward-only check)")
        if missing or failed:
            print(f"CPU smoke FAILED: did not run {sorted(missing)}; over tolerance {[r['candidate'] for r in failed]}")
            return 1
        print("CPU smoke ok: hf_dense, unpacked and sdpa_loop ran, flex's forward matched; the CUDA-only candidates "
              "say why they did not run")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
