"""Whole training steps on the GPU: HF transformers vs foak (vs Liger when importable), each variant in
its own process so that peak memory is clean. Models are built from configs with random weights
(ANCHORS.md dims); input = random token ids, labels = inputs; bf16 weights, fused AdamW, sdpa.

    python3 benchmarks/train_step.py --out DIR [--models llama1b] [--variants hf foak liger]
    python3 benchmarks/train_step.py --one llama1b foak      # a single variant (what the driver runs)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

MODELS = {
    "llama1b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                    tie_word_embeddings=True, max_position_embeddings=8192), 4, 4096),
    "llama8b-8l": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                       max_position_embeddings=8192), 2, 4096),
}
WARMUP, TIMED = 3, 8


def run_one(model_name: str, variant: str) -> dict:
    import transformers

    class_name, dims, batch, seq = MODELS[model_name]
    config = getattr(transformers, class_name)(**dims)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    model.train()
    report = None
    if variant == "foak":
        import foak

        report = str(foak.patch(model, fast_rms_layernorm=True, fast_rope_embeddings=True, fast_swiglu=True,
                                fused_linear_loss=True, mixed_precision="no"))
    elif variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (batch, seq), device="cuda", generator=gen)
               for _ in range(WARMUP + TIMED)]
    losses = []

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for ids in batches[:WARMUP]:
        losses.append(step(ids))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for ids in batches[WARMUP:]:
        losses.append(step(ids))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"model": model_name, "variant": variant, "batch": batch, "seq": seq,
            "tokens_per_s": TIMED * batch * seq / seconds, "step_ms": seconds / TIMED * 1e3,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "losses": [float(x) for x in losses], "patch_report": report}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--variants", nargs="*", default=["hf", "foak", "liger"])
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "VARIANT"))
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(*args.one)), flush=True)
        return 0
    rows = []
    for model_name in args.models:
        for variant in args.variants:
            proc = subprocess.run([sys.executable, __file__, "--one", model_name, variant],
                                  capture_output=True, text=True, env=os.environ)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                rows.append({"model": model_name, "variant": variant, "error": " | ".join(tail)})
            else:
                rows.append(json.loads(line[len("RESULT "):]))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "patch_report"}), flush=True)
    import transformers
    import triton

    result = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__, "warmup_steps": WARMUP, "timed_steps": TIMED, "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "train_step_h200.json").write_text(json.dumps(result, indent=1))
    print("| model | variant | tokens/s | peak GiB | step ms | first losses |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['variant']} | error: {r['error'][:120]} | | | |")
        else:
            print(f"| {r['model']} | {r['variant']} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} | "
                  f"{r['step_ms']:.0f} | {', '.join(f'{x:.4f}' for x in r['losses'][:3])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
