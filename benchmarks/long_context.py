"""Long-context memory on one GPU: the peak memory of one LoRA training step (forward + backward) per sequence
length, HF alone vs + Liger vs + foak, each (framework, length) in its own process (an OOM ends only its own
run).

Setup (the long-context issue's): Llama-3.1-8B dims, all 32 layers, vocab 128256, bf16 weights, PEFT LoRA r16 on
every linear layer, HF gradient checkpointing (non-reentrant unless --reentrant), batch 1, random tokens, sdpa.

    python benchmarks/long_context.py --out $OUT --lengths 131072 196608 --frameworks foak liger
    python benchmarks/long_context.py --cpu-smoke            # tiny dims on CPU: the code path only

Frameworks: none (HF alone), liger, foak (foak.patch defaults), foak-tiled (defaults + tiled_mlp).

Writes ``long_context_h200.json`` (one record per run: peak allocated GiB, step seconds, loss, or the error)
and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DIMS_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=1 << 20, rope_theta=500000.0)
DIMS_TINY = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=301, max_position_embeddings=4096)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def one_run(framework: str, length: int, reentrant: bool, smoke: bool) -> dict:
    import peft
    import torch
    import transformers

    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    config = transformers.LlamaConfig(**(DIMS_TINY if smoke else DIMS_8B))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    if framework == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    model.train()
    report = None
    if framework in ("foak", "foak-tiled"):  # foak-tiled: foak's defaults + tiled_mlp (chunks of hidden size)
        import foak

        switches = foak.patching.default_config(model).model_dump(exclude={"mode"})
        report = foak.patch(model, **{**switches, "tiled_mlp": framework == "foak-tiled"})
    ids = torch.randint(3, config.vocab_size, (1, length), device=device)
    if not smoke:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if not smoke:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    record = {"framework": framework, "length": length, "reentrant": reentrant, "loss": float(loss),
              "step_s": seconds, "tokens_per_s": length / seconds}
    if not smoke:
        record.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                      model_gib=base / 2**30, gpu=torch.cuda.get_device_name(0))
    if report is not None:
        record["report"] = str(report)
    record["versions"] = {m: __import__(m).__version__ for m in ("torch", "transformers", "peft")}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--lengths", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--frameworks", nargs="+", default=["none", "liger", "foak"])
    parser.add_argument("--reentrant", action="store_true")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--one", nargs=2, metavar=("FRAMEWORK", "LENGTH"))
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_run(args.one[0], int(args.one[1]), args.reentrant, args.cpu_smoke)))
        return
    lengths = [64, 256] if args.cpu_smoke else args.lengths
    frameworks = [f for f in args.frameworks if not (args.cpu_smoke and f == "liger")]
    records = []
    for length in lengths:
        for framework in frameworks:
            command = [sys.executable, __file__, "--one", framework, str(length)]
            command += ["--reentrant"] * args.reentrant + ["--cpu-smoke"] * args.cpu_smoke
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                                      env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"))
                line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
                if line is not None:
                    record = json.loads(line[len("RESULT "):])
                else:
                    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                    record = {"framework": framework, "length": length, "error": tail[0][:300]}
            except subprocess.TimeoutExpired:
                record = {"framework": framework, "length": length, "error": f"timeout {args.timeout} s"}
            records.append(record)
            print(json.dumps({k: v for k, v in record.items() if k != "report"}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "long_context_smoke.json" if args.cpu_smoke else "long_context_h200.json")
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {path}\n| framework | length | peak GiB | step s | tokens/s | note |\n|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['framework']} | {r['length']} | {r.get('peak_gib', float('nan')):.1f} | "
              f"{r.get('step_s', float('nan')):.1f} | {r.get('tokens_per_s', float('nan')):.0f} | "
              f"{r.get('error', '')} |")


if __name__ == "__main__":
    main()
