#!/usr/bin/env python3
"""TRL 1.16's fused LM head (trl.trainer.utils._ChunkedLogProbFunction) alone vs served by foak, per trainer
request, at Llama-3.2-1B and Llama-3-8B head dims (vocabulary 128256, bf16 head): fwd+bwd time and peak
memory of the head, after a check that both compute the same numbers.

    python3 benchmarks/trl_fused_head.py --out DIR                                 # on a CUDA GPU
    TRITON_INTERPRET=1 python3 benchmarks/trl_fused_head.py --cpu-smoke --out DIR  # CPU: tiny shapes

One process checks foak against TRL (every request, a few thousand tokens); then each variant (TRL, foak) runs
in its own process per head size. Requests: what the trainers ask (DPO's and KTO's with a per-token gradient
of the log-probs, GRPO's at temperature 0.9 with the entropy only logged (TRL's default) and with an entropy bonus
that differentiates it, SFT's, a reference model's no-grad forward), each with the head trained (full fine-tuning)
and frozen (LoRA). The gradient reaching the log-probs is random per token, except for SFT's request, whose loss is
the mean of the log-probs (a uniform gradient, which foak's SFT path computes in the forward).
``--foak-chunks-mib 256 1024`` adds foak variants with other logits chunk budgets (foak's default: 512 MiB),
``--foak-forward-blocks 16384`` one whose forward row kernels all take that block (foak's default shrinks it as
more statistics are requested); ``--profile`` adds each variant's kernels
(device time per name) for the DPO, GRPO-bonus and reference requests. Writes DIR/trl_fused_head.json; prints a markdown table last; exits
1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REQUESTS = {  # name: (outputs, temperature, differentiate the entropy, training)
    "dpo": (("log_probs", "entropy", "mean_logits", "is_top1"), 1.0, False, True),
    "kto": (("log_probs", "entropy", "mean_logits"), 1.0, False, True),
    "grpo": (("log_probs", "entropy"), 0.9, False, True),  # TRL's default: entropy_coef 0
    "grpo bonus": (("log_probs", "entropy"), 0.9, True, True),  # an entropy bonus differentiates the entropy
    "sft": (("log_probs", "entropy", "is_top1"), 1.0, False, True),
    "reference": (("log_probs",), 1.0, False, False),
}
PROFILED = ("dpo", "grpo bonus", "reference")  # the requests --profile records kernels for
SIZES = {"1b": 2048, "8b": 4096}
VOCAB, TOKENS, CHECK_TOKENS = 128256, 8192, 2048
SMOKE = dict(vocab=301, tokens=64, check_tokens=37, sizes={"tiny": 64})


def head(hidden_size, vocab, device, variant):
    """A 1-layer Llama whose lm_head is the measured head (patched by foak for variant 'foak')."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import foak

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    torch.nn.init.normal_(model.lm_head.weight, std=0.02)
    if variant == "foak":
        foak.patch(model, fused_linear_loss=True)
    return model


def call(weight, hidden, targets, request, frozen):
    """One fwd(+bwd) of the head as TRL calls it; returns (outputs, gradients)."""
    import trl.trainer.utils as trl_utils

    outputs, temperature, entropy_grad, training = REQUESTS[request]
    weight.requires_grad_(training and not frozen)
    weight.grad = None
    h = hidden.detach().requires_grad_(training)
    with torch.set_grad_enabled(training):
        out = trl_utils._ChunkedLogProbFunction.apply(h, weight, None, targets, temperature, 32768, None, 1.0,
                                                      outputs)
    grads = ()
    if training:
        g = torch.Generator(device=hidden.device).manual_seed(1)
        if request == "sft":  # SFT's loss: the mean negative log-likelihood of the tokens
            loss = -out[0].mean()
        else:
            loss = (out[0] * torch.randn(out[0].shape, device=hidden.device, generator=g)).sum()
        if entropy_grad:
            loss = loss + (out[1] * torch.randn(out[1].shape, device=hidden.device, generator=g)).sum()
        loss.backward()
        grads = (h.grad,) + ((weight.grad,) if weight.requires_grad else ())
    return out, grads


def inputs(model, tokens, device):
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, model.config.hidden_size, device=device, generator=g, dtype=torch.bfloat16) * 2
    targets = torch.randint(0, model.config.vocab_size, (tokens,), device=device, generator=g)
    return hidden, targets


def check(args, shapes) -> dict:
    """foak vs TRL on the same inputs (one process, both variants): relative errors of outputs and gradients."""
    import trl.trainer.utils as trl_utils

    from foak.testing import relative_error

    device = "cpu" if args.cpu_smoke else "cuda"
    hidden_size = next(iter(shapes["sizes"].values()))
    model = head(hidden_size, shapes["vocab"], device, "foak")
    hidden, targets = inputs(model, shapes["check_tokens"], device)
    stand_in, results = trl_utils._ChunkedLogProbFunction, {}
    for request in REQUESTS:
        for frozen in ((False, True) if REQUESTS[request][3] else (True,)):
            got = call(model.lm_head.weight, hidden, targets, request, frozen)
            trl_utils._ChunkedLogProbFunction = stand_in.original
            try:
                want = call(model.lm_head.weight, hidden, targets, request, frozen)
            finally:
                trl_utils._ChunkedLogProbFunction = stand_in
            errors = {}
            for name, a, b in zip(("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1",
                                   "d_hidden", "d_weight"), (*got[0], *got[1]), (*want[0], *want[1])):
                if a is not None:
                    errors[name] = (a != b).float().mean().item() if a.dtype == torch.bool else relative_error(a, b)
            # bf16: foak and TRL round the bf16 logits and gradients alike; 2e-2 flags a real difference
            results[f"{request}{' lora' if frozen and REQUESTS[request][3] else ''}"] = {"errors": errors, "ok": all(
                e < (0.02 if "is_top1" not in n else 0.01) for n, e in errors.items())}
    return results


def measure(args, shapes, variant, size) -> dict:
    device = "cpu" if args.cpu_smoke else "cuda"
    for knob in variant.split("-")[1:]:  # foak-cN: a logits chunk budget of N MiB; foak-bN: every forward block N
        if knob[0] == "c":
            import foak.patching.replacements as replacements

            replacements.FUSED_LOSS_CHUNK_BYTES = int(knob[1:]) << 20
        else:
            import foak.ops.cross_entropy as ce
            import foak.ops.linear_log_probs as llp

            llp.TUNING["forward_blocks"] = (int(knob[1:]),) * 4
            ce.TUNING["block_stats"] = int(knob[1:])
    model = head(shapes["sizes"][size], shapes["vocab"], device, "foak" if variant.startswith("foak") else variant)
    hidden, targets = inputs(model, shapes["tokens"], device)
    weight, rows = model.lm_head.weight, {}
    for request in REQUESTS:
        for frozen in ((False, True) if REQUESTS[request][3] else (True,)):
            def run():
                call(weight, hidden, targets, request, frozen)
            run()
            if device == "cuda":
                from foak.bench.measure import spin_median_ms

                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                run()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                ms = spin_median_ms(run, warmup=3, reps=args.reps)
            else:
                t0, peak = time.perf_counter(), float("nan")
                run()
                ms = (time.perf_counter() - t0) * 1e3
            name = f"{request}{' lora' if frozen and REQUESTS[request][3] else ''}"
            rows[name] = {"ms": ms, "peak_mib": peak}
            if args.profile and request in PROFILED and device == "cuda":
                rows[name]["kernels"] = kernel_table(run)
    return rows


def kernel_table(run, top: int = 12) -> list:
    """One call of ``run`` under torch.profiler: its kernels' device time per name, largest first."""
    from foak.bench.measure import kernel_times

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return kernel_times(prof, top)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--foak-chunks-mib", type=int, nargs="*", default=[],
                        help="more foak variants, each with this logits chunk budget (MiB)")
    parser.add_argument("--foak-forward-blocks", type=int, nargs="*", default=[],
                        help="more foak variants, each with this block for every forward row kernel (foak's default "
                             "depends on the statistics requested)")
    parser.add_argument("--profile", action="store_true", help=f"each variant's kernels for {', '.join(PROFILED)}")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # "check" or "VARIANT:SIZE"
    args = parser.parse_args()
    shapes = SMOKE if args.cpu_smoke else dict(vocab=VOCAB, tokens=TOKENS, check_tokens=CHECK_TOKENS, sizes=SIZES)
    if args.child:
        result = check(args, shapes) if args.child == "check" else measure(args, shapes, *args.child.split(":"))
        print("RESULT " + json.dumps(result))
        return 0

    def child(name):
        cmd = [sys.executable, __file__, "--child", name, "--reps", str(args.reps)] + (
            ["--cpu-smoke"] if args.cpu_smoke else []) + (["--profile"] if args.profile else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return {"error": f"exit {proc.returncode}"}
        return json.loads(line[-1][len("RESULT "):])

    from foak.bench.measure import environment

    checks = child("check")
    variants = ("trl", "foak", *(f"foak-c{mib}" for mib in args.foak_chunks_mib),
                *(f"foak-b{block}" for block in args.foak_forward_blocks))
    timings = {f"{variant}:{size}": child(f"{variant}:{size}") for size in shapes["sizes"] for variant in variants}
    ok = "error" not in checks and all(c["ok"] for c in checks.values()) and not any(
        "error" in t for t in timings.values())
    result = {"shapes": {k: v for k, v in shapes.items()}, "checks": checks, "timings": timings, "ok": ok,
              "environment": environment(init_cuda=False)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "trl_fused_head.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(checks, indent=1))
    print(f"\n{shapes['tokens']} tokens, vocabulary {shapes['vocab']}, bf16 head; fwd+bwd ms · peak MiB over the "
          "inputs")
    for size in shapes["sizes"]:
        for variant in variants:
            for name, row in timings[f"{variant}:{size}"].items():
                for k in row.get("kernels", []) if isinstance(row, dict) else []:
                    print(f"kernels {size} {variant} {name} | {k['name']} | {k['calls']} | {k['ms']:.2f}")
    others = variants[1:]
    print("| size | request | TRL | " + " | ".join(others) + " | speed-up (TRL ms / foak ms) |")
    print("|---|---|---|" + "---|" * len(others) + "---|")
    nan = {"ms": float("nan"), "peak_mib": float("nan")}
    for size in shapes["sizes"]:
        trl = timings[f"trl:{size}"]
        for name in trl if "error" not in trl else ():
            a = trl[name]
            got = [timings[f"{v}:{size}"].get(name, nan) for v in others]
            cells = " | ".join(f"{b['ms']:.2f} · {b['peak_mib']:.0f}" for b in got)
            print(f"| {size} | {name} | {a['ms']:.2f} · {a['peak_mib']:.0f} | {cells} | "
                  f"{a['ms'] / got[0]['ms']:.2f}x |")
    print("checks:", "all passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
