"""Whole training steps on the GPU: HF transformers vs foak (vs Liger when importable), each variant in
its own process so that peak memory is clean. Models are built from configs with random weights
(ANCHORS.md dims); input = random token ids, labels = inputs; bf16 weights, fused AdamW, sdpa.

    python3 benchmarks/train_step.py --out DIR [--models llama1b ...] [--variants hf foak liger]
                                     [--checkpointing] [--packed] [--autocast] [--profile] [--lce-chunk-mib N]
                                     [--tag T]
    -> DIR/train_step_h200_<models>[_checkpointing][_packed][_autocast][_T].json
    --autocast: fp32 weights, forward under bf16 autocast (HF Trainer's bf16=True on an fp32 model)
    --lora: PEFT LoRA r16 alpha16 on q,k,v,o,gate,up,down (fp32 adapters on the bf16 base, bf16 autocast);
            the foak variant adds fused_lora
    --qlora: the same on an NF4 base: every decoder projection a bitsandbytes Linear4bit (NF4, double-quantized
             absmax, bf16 compute), quantized from the bf16 random weights (model.is_loaded_in_4bit set, as
             from_pretrained(quantization_config=...) does, so PEFT wraps them in lora.bnb.Linear4bit)
    --gptq: the same on a GPTQ-4bit base: every decoder projection a foak.quant GPTQLinear (round-to-nearest,
            group 128, symmetric, bf16 compute), LoRA through foak's GPTQLoraLinear (register_gptq_lora); the
            hf variant is then foak's unfused GPTQLinear path with PEFT (no other library runs this base)
    python3 benchmarks/train_step.py --one llama1b foak      # a single variant (what the driver runs)
    python3 benchmarks/train_step.py --models tiny --variants hf foak --device cpu --out /tmp/x  # smoke
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
    "mixtral-small": ("MixtralConfig", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                                            num_attention_heads=16, num_key_value_heads=8, num_local_experts=8,
                                            num_experts_per_tok=2, vocab_size=32000,
                                            max_position_embeddings=8192), 4, 4096),
    # CPU smoke test of this script's code paths (--device cpu)
    "tiny": ("LlamaConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=301, max_position_embeddings=256), 2, 64),
}
WARMUP, TIMED = 3, 8


def packed_inputs(batch: int, seq: int, vocab: int, gen, device):
    """Each row packs random-length sequences (seq/16 .. seq/2 tokens) with restarting position_ids;
    labels are -100 at each sequence start (nothing predicts across sequences)."""
    ids = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
    positions = torch.empty((batch, seq), dtype=torch.long)
    labels = ids.clone()
    cpu_gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device=device)))
    for row in range(batch):
        start = 0
        while start < seq:
            n = min(seq - start, int(torch.randint(seq // 16, seq // 2 + 1, (1,), generator=cpu_gen)))
            positions[row, start:start + n] = torch.arange(n)
            labels[row, start] = -100
            start += n
    return {"input_ids": ids, "labels": labels, "position_ids": positions.to(device), "use_cache": False}


# kernel-name patterns -> category of a step's GPU time (first match wins)
CATEGORIES = [
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("optimizer", ("adam", "multi_tensor")),
    ("rms_norm", ("rms_norm", "rmsnorm")),
    ("rope", ("rope", "rotary")),
    ("glu", ("glu", "swiglu", "geglu", "silu")),
    ("loss", ("cross_entropy", "lce", "logsumexp")),
    ("copy/cast", ("copy", "cast", "convert", "to_copy")),
    ("reduce", ("reduce",)),
    ("elementwise", ("elementwise",)),
]


def profile_steps(step, batches, n_steps: int) -> dict:
    """GPU kernel time per step by category and the top kernels, from torch.profiler over n_steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for inputs in batches[:n_steps]:
            step(inputs)
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / n_steps
    kernels = {}
    for event in prof.key_averages():
        # "Optimizer.step#AdamW.step"-style ranges are annotations, not kernels: they would count twice
        if (event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0
                and "#" not in event.key):
            kernels[event.key] = kernels.get(event.key, 0.0) + event.self_device_time_total / 1e3 / n_steps
    by_category = {}
    for name, ms in kernels.items():
        low = name.lower()
        category = next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")
        by_category[category] = by_category.get(category, 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:30]
    return {"wall_ms_per_step_profiled": wall_ms, "kernel_ms_per_step": sum(kernels.values()),
            "by_category_ms": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": [[name[:140], ms] for name, ms in top]}


def quantize_nf4(model, device):
    """Every nn.Linear under model.model (not the LM head) -> bitsandbytes NF4 Linear4bit, double-quantized."""
    import bitsandbytes as bnb
    from torch import nn

    for parent in list(model.model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True,
                                      device="meta")
                q.weight = bnb.nn.Params4bit(child.weight.data.to("cpu" if device == "cpu" else device),
                                             requires_grad=False, quant_type="nf4", compress_statistics=True)
                if child.bias is not None:
                    q.bias = nn.Parameter(child.bias.data, requires_grad=False)
                setattr(parent, name, q.to(device))
    if device == "cuda":
        torch.cuda.empty_cache()
    model.is_loaded_in_4bit = True
    return model


def run_one(model_name: str, variant: str, checkpointing: bool = False, packed: bool = False,
            device: str = "cuda", profile: bool = False, autocast: bool = False, lora: bool = False,
            qlora: bool = False, gptq: bool = False) -> dict:
    import transformers

    class_name, dims, batch, seq = MODELS[model_name]
    config = getattr(transformers, class_name)(**dims)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" and not autocast else torch.float32
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    if qlora:
        model = quantize_nf4(model, device)
        lora = True
    if gptq:
        from foak.quant import quantize_model_gptq

        model = quantize_model_gptq(model, group_size=128, sym=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        lora = True
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:  # adapters in fp32 (PEFT's autocast_adapter_dtype), base frozen in bf16, forward under autocast
        import peft

        lora_config = peft.LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        if gptq:
            from foak.quant.gptq_peft import register_gptq_lora

            register_gptq_lora(lora_config)
        model = peft.get_peft_model(model, lora_config)
        autocast = True
    model.train()
    report = None
    if variant == "foak":
        import foak
        from foak.models import rules_for

        switches = {r.switch for r in rules_for(model)}
        extra = {"fused_lora": True} if lora else {}
        report = (foak.patch(model, fast_rms_layernorm=True, fast_rope_embeddings=True,
                                fast_swiglu="swiglu" in switches, fused_linear_loss=True,
                                fast_moe="moe" in switches,
                                mixed_precision="bf16" if autocast else "no", **extra))
    elif variant == "liger":
        import liger_kernel.transformers as liger

        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel
        getattr(liger, f"apply_liger_kernel_to_{config.model_type}")(model=base)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                                  fused=device == "cuda")
    gen = torch.Generator(device=device).manual_seed(1)
    if packed:
        batches = [packed_inputs(batch, seq, config.vocab_size, gen, device) for _ in range(WARMUP + TIMED)]
    else:
        batches = []
        for _ in range(WARMUP + TIMED):
            ids = torch.randint(0, config.vocab_size, (batch, seq), device=device, generator=gen)
            batches.append({"input_ids": ids, "labels": ids})
    losses = []

    def step(inputs):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    first_start = time.perf_counter()
    for n, inputs in enumerate(batches[:WARMUP]):
        losses.append(step(inputs))
        if n == 0:
            sync()
            first_step_s = time.perf_counter() - first_start  # compilation / autotuning included
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for inputs in batches[WARMUP:]:
        losses.append(step(inputs))
    sync()
    seconds = time.perf_counter() - start
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    profiled = None
    if profile and device == "cuda":
        try:
            profiled = profile_steps(step, batches[WARMUP:], 2)
        except Exception as err:  # the timing above stands; say why the profile is missing
            profiled = {"error": f"{type(err).__name__}: {err}"}
    return {"model": model_name, "variant": variant, "checkpointing": checkpointing, "packed": packed,
            "autocast": autocast, "weights": "nf4" if qlora else "gptq4" if gptq else str(dtype).replace("torch.", ""),
            "lora": lora,
            "batch": batch, "seq": seq, "tokens_per_s": TIMED * batch * seq / seconds,
            "step_ms": seconds / TIMED * 1e3,
            "peak_gib": peak_gib, "first_step_s": first_step_s, "losses": [float(x) for x in losses],
            "patch_report": None if report is None else str(report),  # after the steps: with call counts
            "profile": profiled}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--variants", nargs="*", default=["hf", "foak", "liger"])
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (non-reentrant)")
    parser.add_argument("--packed", action="store_true", help="rows of packed variable-length sequences")
    parser.add_argument("--autocast", action="store_true", help="fp32 weights + bf16 autocast")
    parser.add_argument("--lora", action="store_true", help="PEFT LoRA r16 on every projection (bf16 base)")
    parser.add_argument("--qlora", action="store_true", help="PEFT LoRA r16 on a bitsandbytes NF4 base")
    parser.add_argument("--gptq", action="store_true", help="PEFT LoRA r16 on a foak GPTQ-4bit base")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the code paths (use --models tiny)")
    parser.add_argument("--lce-chunk-mib", type=int, default=0,
                        help="foak: linear_cross_entropy's chunk budget (default: its TUNING value)")
    parser.add_argument("--tag", default="", help="suffix of the result file name")
    parser.add_argument("--profile", action="store_true", help="also profile 2 steps: GPU time by kernel category")
    parser.add_argument("--moe-recompute", action="store_true",
                        help="foak: moe_experts recomputes the [S, 2I] gate/up product in the backward")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "VARIANT"))
    args = parser.parse_args()
    if args.one:
        if args.moe_recompute:
            from foak.ops import moe

            moe.TUNING["recompute_h"] = True
        if args.lce_chunk_mib:
            from foak.ops import linear_cross_entropy as lce
            from foak.patching import replacements

            lce.TUNING["chunk_bytes"] = args.lce_chunk_mib * 2**20
            replacements.FUSED_LOSS_CHUNK_BYTES = args.lce_chunk_mib * 2**20  # what the patched model uses
        result = run_one(*args.one, checkpointing=args.checkpointing, packed=args.packed, device=args.device,
                         profile=args.profile, autocast=args.autocast, lora=args.lora, qlora=args.qlora,
                         gptq=args.gptq)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    flags = [f for f, on in (("--checkpointing", args.checkpointing), ("--packed", args.packed),
                             ("--autocast", args.autocast), ("--lora", args.lora), ("--qlora", args.qlora), ("--gptq", args.gptq),
                             ("--profile", args.profile), ("--moe-recompute", args.moe_recompute)) if on]
    if args.lce_chunk_mib:
        flags += ["--lce-chunk-mib", str(args.lce_chunk_mib)]
    rows = []
    for model_name in args.models:
        for variant in args.variants:
            proc = subprocess.run([sys.executable, __file__, "--one", model_name, variant, *flags,
                                   "--device", args.device], capture_output=True, text=True, env=os.environ)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                rows.append({"model": model_name, "variant": variant, "error": " | ".join(tail)})
            else:
                rows.append(json.loads(line[len("RESULT "):]))
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("patch_report", "profile")}), flush=True)
    import transformers
    import triton

    try:
        from importlib.metadata import version

        liger_version = version("liger-kernel")
    except Exception:  # not installed: no liger rows either
        liger_version = None
    result = {"liger_kernel": liger_version, "lce_chunk_mib": args.lce_chunk_mib or "default", "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke test)", "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__, "warmup_steps": WARMUP, "timed_steps": TIMED, "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    suffix = "_" + "_".join(args.models)  # one file per set of models: runs do not overwrite each other
    suffix += "".join(f"_{f.lstrip('-')}" for f in flags if f.startswith("--") and f not in ("--profile", "--lce-chunk-mib"))
    if args.tag:
        suffix += f"_{args.tag}"
    (Path(args.out) / f"train_step_h200{suffix}.json").write_text(json.dumps(result, indent=1))
    print("| model | variant | tokens/s | peak GiB | step ms | first step s | first losses |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['variant']} | error: {r['error'][:120]} | | | | |")
        else:
            print(f"| {r['model']} | {r['variant']} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} | "
                  f"{r['step_ms']:.0f} | {r['first_step_s']:.1f} | {', '.join(f'{x:.4f}' for x in r['losses'][:3])} |")
    for r in rows:
        if r.get("profile") and "error" in r["profile"]:
            print(f"profile {r['model']} {r['variant']}: {r['profile']['error']}")
        elif r.get("profile"):
            p = r["profile"]
            parts = ", ".join(f"{c} {ms:.1f}" for c, ms in p["by_category_ms"].items())
            print(f"profile {r['model']} {r['variant']}: step {p['wall_ms_per_step_profiled']:.1f} ms, "
                  f"kernels {p['kernel_ms_per_step']:.1f} ms: {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
