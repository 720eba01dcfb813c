"""Causal self-attention at long sequence lengths through torch's SDPA backends (FlashAttention-2 vs cuDNN vs
memory-efficient), forward + backward, Llama-3.1-8B heads (32 query heads, 8 KV heads expanded, head dim 128), bf16,
batch 1: agreement with the flash backend (max abs error of out, dq, dk, dv over max abs value) and milliseconds.
The attention is what dominates a long-context training step (about 2/3 of a Llama-8B LoRA step at 131k tokens).

    python benchmarks/attention_backends.py --out $OUT --lengths 32768 65536 131072
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "default": None}  # default: SDPA's own choice


def run(backend: str, q, k, v, dout, repeats: int) -> tuple[float, tuple]:
    import contextlib

    with sdpa_kernel(BACKENDS[backend]) if BACKENDS[backend] is not None else contextlib.nullcontext():
        def once():
            for t in (q, k, v):
                t.grad = None
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(dout)
            return out

        out = once()  # warm-up (and the result compared)
        if not repeats:
            return float("nan"), (out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            once()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / repeats * 1e3
    return ms, (out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())


def check(lengths: list[int]) -> list[dict]:
    """Each backend's bf16 out/dq/dk/dv vs an fp32 math-backend reference of the same inputs (max abs error over
    max abs value): which backends are as exact as flash, at odd lengths too."""
    records = []
    for length in lengths:
        torch.manual_seed(0)
        shape = (1, 32, length, 128)
        base = [torch.randn(shape, device="cuda") for _ in range(3)]
        dout = torch.randn(shape, device="cuda")
        ref_in = [t.clone().requires_grad_() for t in base]
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(*ref_in, is_causal=True)
            out.backward(dout)
        ref = (out.detach(), *(t.grad for t in ref_in))
        for backend in BACKENDS:
            q, k, v = (t.bfloat16().requires_grad_() for t in base)
            try:
                _, got = run(backend, q, k, v, dout.bfloat16(), 0)
            except Exception as err:
                records.append({"check": length, "backend": backend, "error": str(err).splitlines()[0][:200]})
                continue
            records.append({"check": length, "backend": backend, "rel_err_vs_fp32": {
                n: float((a.float() - b).abs().max() / b.abs().max())
                for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}})
            print(json.dumps(records[-1]), flush=True)
        del base, dout, ref_in, out, ref
        torch.cuda.empty_cache()
    return records


def model_check(length: int = 8192) -> dict:
    """foak's cudnn_attention switch in a model (CUDA): a 2-layer Llama with Llama-8B attention (32 query heads,
    8 KV heads, head dim 128), bf16, one sequence of ``length`` tokens, gradient checkpointing: the loss and every
    gradient of foak with cudnn_attention vs foak without (SDPA's default choice) vs the unpatched model in fp32;
    the report's counts say which path ran."""
    import copy

    import transformers

    import foak
    from foak.patching.packed_attention import packed_attention_counts

    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=1024,
                                      max_position_embeddings=length)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).cuda()
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(3, config.vocab_size, (1, length), device="cuda")

    def grads(model):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss), {n: p.grad.float() for n, p in model.named_parameters()}

    loss32, g32 = grads(ref)
    out = {"length": length, "loss_fp32": loss32}
    for name, switches in (("default", {}), ("cudnn", {"cudnn_attention": True})):
        model = copy.deepcopy(ref).bfloat16()
        report = foak.patch(model, fast_packed_attention=True, **switches)
        loss, g = grads(model)
        worst = max(float((g[n] - g32[n]).abs().max() / g32[n].abs().max()) for n in g32)
        out[name] = {"loss_rel_err": abs(loss - loss32) / abs(loss32), "worst_grad_rel_err": worst,
                     "calls": packed_attention_counts(report, "llama.packed_attention")[1]}
        foak.restore(model)
        del model
    out["ok"] = (out["cudnn"]["worst_grad_rel_err"] <= 2 * out["default"]["worst_grad_rel_err"] + 1e-3
                 and out["cudnn"]["loss_rel_err"] <= 2 * out["default"]["loss_rel_err"] + 1e-3
                 and set(out["cudnn"]["calls"]) == {"not a packed batch: sdpa with cuDNN attention"})
    print("MODEL " + json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--lengths", nargs="+", type=int, default=[32768, 65536, 131072])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--check-lengths", nargs="*", type=int, default=[4096, 4099],
                        help="lengths of the accuracy check vs an fp32 reference (before the timing)")
    parser.add_argument("--model-check", action="store_true",
                        help="first: foak's cudnn_attention switch in a 2-layer model vs flash and fp32")
    args = parser.parse_args()
    records = [model_check()] if args.model_check else []
    records += check(args.check_lengths)
    for length in args.lengths:
        torch.manual_seed(0)
        shape = (1, 32, length, 128)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
        dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        results = {}
        for backend in BACKENDS:
            try:
                results[backend] = run(backend, q, k, v, dout, args.repeats)
            except Exception as err:  # a backend that does not take these inputs: say so
                records.append({"length": length, "backend": backend, "error": str(err).splitlines()[0][:200]})
                print(json.dumps(records[-1]), flush=True)
                continue
        # grouped K/V heads (Llama-8B: 8 KV heads) as transformers' sdpa path calls it (enable_gqa=True): does
        # cuDNN take it (torch's own check, what foak's cudnn_attention reads), and how fast
        kv = (torch.randn((1, 8, length, 128), device="cuda", dtype=torch.bfloat16).requires_grad_()
              for _ in range(2))
        k8, v8 = kv
        params = torch.backends.cuda.SDPAParams(q, k8, v8, None, 0.0, True, True)
        records.append({"length": length, "gqa_cudnn_accepts": torch.backends.cuda.can_use_cudnn_attention(params),
                        "gqa_flash_accepts": torch.backends.cuda.can_use_flash_attention(params)})
        print(json.dumps(records[-1]), flush=True)
        for backend in ("flash", "cudnn"):
            try:
                with sdpa_kernel(BACKENDS[backend]):
                    def once():
                        for t in (q, k8, v8):
                            t.grad = None
                        F.scaled_dot_product_attention(q, k8, v8, is_causal=True, enable_gqa=True).backward(dout)
                    once()
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(args.repeats):
                        once()
                    torch.cuda.synchronize()
                records.append({"length": length, "backend": f"{backend}-gqa",
                                "fwd_bwd_ms": (time.perf_counter() - start) / args.repeats * 1e3})
            except Exception as err:
                records.append({"length": length, "backend": f"{backend}-gqa", "error": str(err).splitlines()[0][:200]})
            print(json.dumps(records[-1]), flush=True)
        del k8, v8
        ref = results.get("flash")
        for backend, (ms, tensors) in results.items():
            rec = {"length": length, "backend": backend, "fwd_bwd_ms": ms,
                   "tflops": 3.5 * 2 * 2 * length * length * 128 * 32 / 2 / ms / 1e9}
            if ref is not None:
                rec["rel_err_vs_flash"] = {n: float((a.float() - b.float()).abs().max() / b.float().abs().max())
                                           for n, a, b in zip(("out", "dq", "dk", "dv"), tensors, ref[1])}
            records.append(rec)
            print(json.dumps(rec), flush=True)
        del q, k, v, dout, results, ref
        torch.cuda.empty_cache()
    order = [SDPBackend(int(b)).name if isinstance(b, int) else str(b) for b in torch._C._get_sdp_priority_order()]
    records.append({"versions": {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version()},
                    "gpu": torch.cuda.get_device_name(0), "sdpa_priority_order": order})
    print(json.dumps(records[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention_backends_h200.json"), "w") as f:
        json.dump(records, f, indent=1)
    print("| length | backend | fwd+bwd ms | TFLOP/s | max rel err (vs flash, or vs fp32) |\n|---|---|---|---|---|")
    for r in records:
        if "check" in r:
            err = max(r.get("rel_err_vs_fp32", {"-": float("nan")}).values())
            print(f"| {r['check']} (vs fp32) | {r['backend']} | | | {err:.1e} | {r.get('error', '')}")
        if "backend" in r and "length" in r:
            err = max(r.get("rel_err_vs_flash", {"-": float("nan")}).values())
            print(f"| {r['length']} | {r['backend']} | {r.get('fwd_bwd_ms', float('nan')):.0f} | "
                  f"{r.get('tflops', float('nan')):.0f} | {err:.1e} | {r.get('error', '')}")


if __name__ == "__main__":
    main()
