"""GPU check: foak's kernels on whole tensors of more than 2**31 elements (long-context shapes), the rows or heads
past 2**31 compared with the fp32 reference of the same rows (tests/test_large_offsets.py does this on CPU with
views into lazily mapped storages; here the compiled kernels run on real tensors).

    python3 benchmarks/large_offsets.py --out $OUT                       # CUDA: ~35 GiB of GPU memory, seconds
    TRITON_INTERPRET=1 python3 benchmarks/large_offsets.py --cpu-smoke --out /tmp/x   # small: the code path

Cases: RoPE on a contiguous q [1, 32, 544000, 128] and its gradient in that layout (head 31 starts at 2.16e9
elements); RMSNorm forward and backward on [1048576, 4096] (4.3e9 elements); cross-entropy forward and backward
on [17000, 128256] logits (2.2e9 elements). Each compares the first and the last rows / heads with the
reference in fp32 (bf16 bound 2e-2, foak.testing.relative_error: norm of the difference over the reference's).
Writes large_offsets_h200.json; prints a table last; exits 1 if a case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from foak.ops.cross_entropy import cross_entropy, cross_entropy_reference
from foak.ops.rms_norm import rms_norm, rms_norm_reference
from foak.ops.rope import rope, rope_reference
from foak.testing import relative_error as rel

TOL = 2e-2
FULL = dict(rope_len=544_000, norm_rows=1 << 20, ce_rows=17_000, vocab=128256, hidden=4096)
SMOKE = dict(rope_len=40, norm_rows=70, ce_rows=9, vocab=1000, hidden=64)


def check_rope(n: int, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    heads, kv_heads, dim = 32, 8, 128
    q = torch.randn(1, heads, n, dim, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(1, kv_heads, n, dim, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    angles = torch.rand(1, n, dim // 2, device=device, generator=gen) * 6.3
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    q_out, k_out = rope(q, k, cos, sin)
    dq_out = torch.randn_like(q_out)  # contiguous: the gradient's head 31 lies past 2**31 as well
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, torch.ones_like(k_out)))
    worst = 0.0
    for h in (0, heads - 1):
        for span in (slice(0, min(64, n)), slice(max(n - 64, 0), n)):  # positions at both ends of the sequence
            qs = q.detach()[:, h:h + 1, span].float().requires_grad_()
            ks = k.detach()[:, :1, span].float()
            ref_q, _ = rope_reference(qs, ks, cos[:, span].float(), sin[:, span].float())
            (ref_dq,) = torch.autograd.grad(ref_q, qs, dq_out[:, h:h + 1, span].float())
            worst = max(worst, rel(q_out[:, h:h + 1, span], ref_q), rel(dq[:, h:h + 1, span], ref_dq))
    return {"case": "rope", "shape": list(q.shape), "elements": q.numel(), "worst_rel": worst}


def check_rms_norm(rows: int, hidden: int, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (1 + 0.1 * torch.randn(hidden, device=device, generator=gen)).to(torch.bfloat16).requires_grad_()
    y = rms_norm(x, w, inplace_backward=False)
    dy = torch.randn_like(y)
    dx, _ = torch.autograd.grad(y, (x, w), dy)
    worst = 0.0
    for span in (slice(0, min(64, rows)), slice(max(rows - 64, 0), rows)):
        xs = x.detach()[span].float().requires_grad_()
        ref = rms_norm_reference(xs, w.detach().float())
        (ref_dx,) = torch.autograd.grad(ref, xs, dy[span].float())
        worst = max(worst, rel(y[span], ref), rel(dx[span], ref_dx))
    return {"case": "rms_norm", "shape": list(x.shape), "elements": x.numel(), "worst_rel": worst}


def check_cross_entropy(rows: int, vocab: int, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(2)
    logits = (2 * torch.randn(rows, vocab, device=device, generator=gen)).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    loss = cross_entropy(logits, target, reduction="none")
    (dlogits,) = torch.autograd.grad(loss.sum(), logits)
    worst = 0.0
    for span in (slice(0, min(8, rows)), slice(max(rows - 8, 0), rows)):
        ls = logits.detach()[span].float().requires_grad_()
        ref = cross_entropy_reference(ls, target[span], reduction="none")
        (ref_d,) = torch.autograd.grad(ref.sum(), ls)
        worst = max(worst, rel(loss[span], ref), rel(dlogits[span], ref_d))
    return {"case": "cross_entropy", "shape": list(logits.shape), "elements": logits.numel(), "worst_rel": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.cpu_smoke else "cuda"
    torch.manual_seed(0)  # the incoming gradients (randn_like)
    dims = SMOKE if args.cpu_smoke else FULL
    cases = {"rope": lambda: check_rope(dims["rope_len"], device),
             "rms_norm": lambda: check_rms_norm(dims["norm_rows"], dims["hidden"], device),
             "cross_entropy": lambda: check_cross_entropy(dims["ce_rows"], dims["vocab"], device)}
    records = []
    for name, case in cases.items():
        start = time.perf_counter()
        try:
            record = case()
            record["ok"] = record["worst_rel"] <= TOL
        except Exception as e:  # an OOM or a kernel error is this case's result; the others still run
            record = {"case": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
        record["seconds"] = time.perf_counter() - start
        if device == "cuda":
            torch.cuda.synchronize()
            record["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        records.append(record)
        print(json.dumps(record), flush=True)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "large_offsets_smoke.json" if args.cpu_smoke else "large_offsets_h200.json")
    with open(path, "w") as f:
        json.dump({"environment": env, "cases": records}, f, indent=1)
    print(f"wrote {path}\n| case | shape | elements | worst rel | ok |\n|---|---|---|---|---|")
    for r in records:
        worst = r.get("worst_rel", float("nan"))
        print(f"| {r['case']} | {r.get('shape', '')} | {r.get('elements', '')} | {worst:.2e} "
              f"| {r['ok']}{' ' + r['error'] if 'error' in r else ''} |")
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
