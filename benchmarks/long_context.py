"""Long-context memory on one GPU: the peak memory of one LoRA training step (forward + backward) per sequence
length, HF alone vs + Liger vs + foak, each (framework, length) in its own process (an OOM ends only its own
run).

Setup (the long-context issue's): Llama-3.1-8B dims, all 32 layers, vocab 128256, bf16 weights, PEFT LoRA r16 on
every linear layer, HF gradient checkpointing (non-reentrant unless --reentrant), batch 1, random tokens, sdpa.

    python benchmarks/long_context.py --out $OUT --lengths 131072 196608 --frameworks foak liger
    python benchmarks/long_context.py --cpu-smoke            # tiny dims on CPU: the code path only
    python benchmarks/long_context.py --check-offload        # GPU: offload_activations' correctness check

Framework ``foak-offload``: foak's default switches plus ``offload_activations`` (the checkpointed layers'
inputs in pinned host memory; ``--offload-budget-gib`` caps it, default half the available RAM); its record says
how many layers were offloaded and how many bytes.

Frameworks: none (HF alone), liger, foak (foak.patch defaults), foak-tiled (defaults + tiled_mlp), foak-long
(defaults + both: what `foak train --long_context` runs).

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


def one_run(framework: str, length: int, reentrant: bool, smoke: bool, budget_gib: float | None = None,
            warmup: int = 0, qlora: bool = False) -> dict:
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
    if qlora:  # every decoder projection NF4 (double-quantized), as from_pretrained with a BitsAndBytesConfig
        from foak.bench.step import quantize_nf4

        quantize_nf4(model, device)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    model.train()
    report = None
    if framework in ("foak", "foak-offload", "foak-tiled", "foak-long"):
        import foak
        from foak.config import config_from_kwargs
        from foak.patching import default_config

        # foak-offload: + offload_activations; foak-tiled: + tiled_mlp (chunks of the hidden size); foak-long: both
        acceleration = default_config(model)
        extra = {}
        if framework in ("foak-offload", "foak-long"):
            extra.update(offload_activations=True, offload_budget_gib=budget_gib)
        if framework in ("foak-tiled", "foak-long"):
            extra.update(tiled_mlp=True)
        if extra:
            switches = {**acceleration.model_dump(exclude={"mode"}), **extra}
            acceleration = config_from_kwargs(acceleration.mode, **switches)
        report = foak.patch(model, acceleration)
    ids = torch.randint(3, config.vocab_size, (1, length), device=device)
    for _ in range(warmup):  # e.g. the first step's pinned host allocations (foak-offload) left out of the timing
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
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
    record = {"framework": framework, "length": length, "reentrant": reentrant, "warmup_steps": warmup,
              "base": "nf4" if qlora else "bf16",
              "loss": float(loss),
              "step_s": seconds, "tokens_per_s": length / seconds}
    if not smoke:
        record.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                      model_gib=base / 2**30, gpu=torch.cuda.get_device_name(0))
    if report is not None:
        record["report"] = str(report)
    if framework in ("foak-offload", "foak-long"):
        from foak.patching.offload import state_of

        stacks = [m for m in model.modules() if "offloaded_layers" in state_of(m)]
        record["offload"] = {k: sum(state_of(m)[k] for m in stacks)
                             for k in ("layers", "offloaded_layers", "kept_layers", "offloaded_bytes")}
    record["versions"] = {m: __import__(m).__version__ for m in ("torch", "transformers", "peft")}
    return record


def offloaded(record: dict) -> str:
    o = record.get("offload")
    return "" if not o else (f"{o['offloaded_layers']} of {o['layers']} layers offloaded "
                             f"({o['offloaded_bytes'] / 2**30:.1f} GiB pinned)")


def offload_check(reentrant: bool) -> dict:
    """On the GPU (a check, not timed): foak with offload_activations vs the same model without, a 6-layer Llama
    (hidden 256) at 4096 tokens, fp32: the same loss and gradients (1e-5), pinned host copies, and what the
    forward leaves allocated on the GPU drops by at least all but one layer input."""
    import copy

    import torch
    import transformers

    import foak
    from foak.patching import offload

    config = transformers.LlamaConfig(**{**DIMS_TINY, "num_hidden_layers": 6, "hidden_size": 256,
                                         "intermediate_size": 512})
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).float().cuda()
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ref.enable_input_require_grads()
    ref.train()
    model = copy.deepcopy(ref)
    foak.patch(model, offload_activations=True)
    hosts, real = [], offload._host_buffer
    offload._host_buffer = lambda t: hosts.append(real(t)) or hosts[-1]
    ids = torch.randint(3, config.vocab_size, (1, 4096), device="cuda")

    def run(m):
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = m(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        loss.backward()
        return kept, loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    try:
        run(ref)  # warm-up (cuBLAS workspaces)
        (base, loss_ref, grads_ref), (ours, loss, grads) = run(ref), run(model)
    finally:
        offload._host_buffer = real
    per_layer = 4096 * 256 * 4
    worst = max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in grads_ref.items())
    ok = (base - ours >= (config.num_hidden_layers - 1) * per_layer and bool(hosts)
          and all(h.is_pinned() for h in hosts) and abs(float(loss - loss_ref)) <= 1e-5 * abs(float(loss_ref))
          and worst <= 1e-5 and grads.keys() == grads_ref.keys())
    return {"check": f"offload/{'reentrant' if reentrant else 'nonreentrant'}", "ok": ok,
            "kept_without_mib": base / 2**20, "kept_with_mib": ours / 2**20, "host_copies": len(hosts),
            "pinned": all(h.is_pinned() for h in hosts), "worst_grad_rel": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--lengths", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--frameworks", nargs="+", default=["none", "liger", "foak"])
    parser.add_argument("--reentrant", action="store_true")
    parser.add_argument("--qlora", action="store_true", help="NF4 (bitsandbytes) base under the LoRA adapters")
    parser.add_argument("--json-name", default=None, help="result file name (default long_context_h200.json)")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--one", nargs=2, metavar=("FRAMEWORK", "LENGTH"))
    parser.add_argument("--check-offload", action="store_true",
                        help="GPU: offloaded == not offloaded, pinned host copies, layer inputs off the GPU")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--stop-on-fail", action="store_true",
                        help="after a framework fails (OOM, timeout) at one length, skip its longer lengths")
    parser.add_argument("--warmup-steps", type=int, default=0, help="untimed steps before the measured one")
    parser.add_argument("--offload-budget-gib", type=float, default=None,
                        help="foak-offload: host memory for offloaded layer inputs (default: half the available RAM)")
    args = parser.parse_args()
    if args.check_offload:
        for reentrant in (False, True):
            print("CHECK " + json.dumps(offload_check(reentrant)), flush=True)
        return
    if args.one:
        print("RESULT " + json.dumps(one_run(args.one[0], int(args.one[1]), args.reentrant, args.cpu_smoke,
                                                  args.offload_budget_gib, args.warmup_steps, args.qlora)))
        return
    lengths = [64, 256] if args.cpu_smoke else args.lengths
    frameworks = [f for f in args.frameworks if not (args.cpu_smoke and f == "liger")]
    records, failed = [], set()
    for length in lengths:
        for framework in frameworks:
            if framework in failed:  # --stop-on-fail: a framework that failed a shorter length is not run again
                continue
            command = [sys.executable, __file__, "--one", framework, str(length)]
            command += ["--reentrant"] * args.reentrant + ["--cpu-smoke"] * args.cpu_smoke + ["--qlora"] * args.qlora
            command += ["--warmup-steps", str(args.warmup_steps)]
            if args.offload_budget_gib is not None:
                command += ["--offload-budget-gib", str(args.offload_budget_gib)]
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
            if args.stop_on_fail and "error" in record:
                failed.add(framework)
            print(json.dumps({k: v for k, v in record.items() if k != "report"}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    name = args.json_name or ("long_context_smoke.json" if args.cpu_smoke else "long_context_h200.json")
    path = os.path.join(args.out, name)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {path}\n| framework | base | length | peak GiB | step s | tokens/s | note |\n|---|---|---|---|---|---|---|")
    for r in records:
        base = r.get("base", "nf4" if args.qlora else "bf16")
        print(f"| {r['framework']} | {base} | {r['length']} | {r.get('peak_gib', float('nan')):.1f} | "
              f"{r.get('step_s', float('nan')):.1f} | {r.get('tokens_per_s', float('nan')):.0f} | "
              f"{r.get('error', '') or offloaded(r)} |")


if __name__ == "__main__":
    main()
