"""One ``foak bench`` experiment in this process: build the model, apply PEFT and the framework, run warm-up
and timed training steps on random tokens, measure.

The step is a plain loop (forward under the experiment's autocast, backward, AdamW step, zero_grad: fused AdamW
on CUDA), the one behind the README's training-step tables (``benchmarks/train_step.py`` runs it too). Inputs
are random token ids with labels = inputs; ``packing`` makes each row a pack of random-length sequences with
restarting ``position_ids`` (labels -100 at each sequence start). Several GPUs (``torchrun``): every rank trains
its own batches under DistributedDataParallel; tokens/s counts all ranks, memory is the largest rank's."""

from __future__ import annotations

import math
import os
import statistics
import time

import torch

from foak.bench.measure import SmiSampler, StepTimer, peak_memory, relative_spread, reset_peak_memory
from foak.bench.models import BUILTIN_MODELS


# ---- inputs ----------------------------------------------------------------------------------------------
def random_inputs(batch: int, seq: int, vocab: int, gen: torch.Generator, device) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
    return {"input_ids": ids, "labels": ids}


def packed_inputs(batch: int, seq: int, vocab: int, gen: torch.Generator, device) -> dict:
    """Each row packs random-length sequences (seq/16 .. seq/2 tokens) with restarting position_ids; labels are
    -100 at each sequence start (nothing predicts across sequences)."""
    ids = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
    positions = torch.empty((batch, seq), dtype=torch.long)
    labels = ids.clone()
    cpu_gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device=device)))
    for row in range(batch):
        start = 0
        while start < seq:
            n = min(seq - start, int(torch.randint(max(seq // 16, 1), seq // 2 + 1, (1,), generator=cpu_gen)))
            positions[row, start:start + n] = torch.arange(n)
            labels[row, start] = -100
            start += n
    return {"input_ids": ids, "labels": labels, "position_ids": positions.to(device), "use_cache": False}


# ---- precision -------------------------------------------------------------------------------------------
def weights_dtype(exp: dict, device: torch.device) -> torch.dtype:
    """bf16: bf16 weights (a PEFT run: the frozen base, adapters fp32); the other precisions load fp32."""
    return torch.bfloat16 if exp["precision"] == "bf16" else torch.float32


def autocast_dtype(exp: dict) -> torch.dtype | None:
    """The forward's autocast dtype: bf16/fp16 for the *-autocast precisions, bf16 for a PEFT run in bf16 (fp32
    adapters over the bf16 base, as HF + PEFT train it), None otherwise."""
    if exp["precision"] == "bf16-autocast" or (exp["precision"] == "bf16" and exp["peft"] != "none"):
        return torch.bfloat16
    if exp["precision"] == "fp16-autocast":
        return torch.float16
    return None


def mixed_precision(exp: dict) -> str:
    dtype = autocast_dtype(exp)
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "no")


# ---- the model -------------------------------------------------------------------------------------------
def build_model(exp: dict, device: torch.device):
    """(model, description): random weights for a built-in shape or ``init: random``, else the checkpoint's."""
    import transformers

    spec = exp["model_spec"]
    dtype = weights_dtype(exp, device)
    torch.manual_seed(exp["seed"])
    if spec["builtin"] is not None:
        config = BUILTIN_MODELS[spec["builtin"]].config(**spec["overrides"])
        config._attn_implementation = exp["attn_implementation"]
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        about = BUILTIN_MODELS[spec["builtin"]].about or spec["builtin"]
    else:
        from foak.model_source import resolve_model

        source = resolve_model(spec["path"] or spec["hub"], flag=f"model {exp['model']}", need_tokenizer=False)
        hub = {"local_files_only": True} if source.local_files_only else {}
        config = transformers.AutoConfig.from_pretrained(source.ref, **hub, **spec["overrides"])
        if spec["init"] == "random":
            config._attn_implementation = exp["attn_implementation"]
            with torch.device(device):
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
            about = f"{source} (config only, random weights)"
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                source.ref, config=config, dtype=dtype, attn_implementation=exp["attn_implementation"], **hub)
            model = model.to(device)
            about = str(source)
    model.config.use_cache = False
    return model, about


def quantize_nf4(model, device, compute_dtype=torch.bfloat16):
    """Every nn.Linear under model.model (not the LM head) -> bitsandbytes NF4 Linear4bit, double-quantized
    absmax, quantized from the model's weights (model.is_loaded_in_4bit set, as from_pretrained with a
    BitsAndBytesConfig does, so PEFT wraps them in lora.bnb.Linear4bit)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ValueError("peft qlora-nf4 needs bitsandbytes: pip install bitsandbytes"
                         " (foak's train extra has it)") from None
    from torch import nn

    device = torch.device(device)
    for parent in list(model.model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=compute_dtype, quant_type="nf4", compress_statistics=True,
                                      device="meta")
                q.weight = bnb.nn.Params4bit(child.weight.data.to(device), requires_grad=False, quant_type="nf4",
                                             compress_statistics=True)
                if child.bias is not None:
                    q.bias = nn.Parameter(child.bias.data, requires_grad=False)
                setattr(parent, name, q.to(device))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model.is_loaded_in_4bit = True
    return model


def gptq_group_size(model) -> int:
    """128 (the usual GPTQ group) when every quantized linear's input width is a multiple of it, else -1 (one
    group per output row: the tiny CPU models)."""
    from torch import nn

    widths = {m.in_features for n, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in n}
    return 128 if all(w % 128 == 0 for w in widths) else -1


def apply_peft(model, exp: dict, device: torch.device) -> tuple:
    """(model, note): PEFT LoRA r/alpha/dropout on target_modules, over the base the peft method says."""
    note = ""
    if exp["peft"] == "qlora-nf4":
        compute = autocast_dtype(exp) or weights_dtype(exp, device)
        model = quantize_nf4(model, device, compute)
        note = f"NF4 base (bitsandbytes, double-quantized absmax, {str(compute).removeprefix('torch.')} compute)"
    elif exp["peft"] == "gptq-lora":
        from foak.quant import quantize_model_gptq

        group = gptq_group_size(model)
        model = quantize_model_gptq(model, group_size=group, sym=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        note = f"GPTQ-4bit base (foak.quant, round-to-nearest, group {group}, symmetric)"
    if exp["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if exp["peft"] == "none":
        return model, note
    try:
        import peft
    except ImportError:
        raise ValueError(f"peft {exp['peft']} needs peft: pip install peft (foak's train extra has it)") from None
    lora_config = peft.LoraConfig(r=exp["lora_r"], lora_alpha=exp["lora_alpha"], lora_dropout=exp["lora_dropout"],
                                  target_modules=list(exp["target_modules"]))
    if exp["peft"] == "gptq-lora":
        from foak.quant.gptq_peft import register_gptq_lora

        register_gptq_lora(lora_config)
    return peft.get_peft_model(model, lora_config), note


def apply_framework(model, exp: dict):
    """Patch the model as the experiment's framework says; returns (model, foak PatchReport or None)."""
    fw = exp["framework_spec"]
    kind = fw["kind"]
    if kind == "none":
        return model, None
    if kind == "foak":
        import foak
        from foak.config import config_from_kwargs

        if fw["switches"] is not None:
            config = config_from_kwargs("peft" if exp["peft"] != "none" else "full", **fw["switches"])
        else:
            config = fw["config"]  # a YAML path, or None: every switch foak has for the model
        return model, foak.patch(model, config, mixed_precision=mixed_precision(exp))
    if kind == "liger":
        try:
            import liger_kernel.transformers as liger
        except ImportError:
            raise ValueError("framework liger: liger-kernel is not installed (pip install liger-kernel)") from None
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel
        model_type = base.config.model_type
        apply = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)
        if apply is None:  # e.g. qwen3_5_text: liger's own table maps the text model types to their functions
            from liger_kernel.transformers import monkey_patch

            apply = getattr(monkey_patch, "MODEL_TYPE_TO_APPLY_LIGER_FN", {}).get(model_type)
        if apply is None:
            raise ValueError(f"framework liger: liger-kernel has no apply_liger_kernel_to_{base.config.model_type}")
        apply(model=base, **fw["options"])
        return model, None
    if kind == "python":
        import importlib

        module_name, _, func_name = fw["callable"].partition(":")
        func = getattr(importlib.import_module(module_name), func_name)
        returned = func(model, exp)
        return (model if returned is None else returned), None
    raise ValueError(f"unknown framework kind {kind!r}")


# ---- the run ---------------------------------------------------------------------------------------------
def resolve_device(exp: dict) -> torch.device:
    want = exp["device"]
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device cuda: no CUDA GPU is available here")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def run_experiment(exp: dict, after_timed=None) -> dict:
    """Run one experiment here; returns its measurements (status "ok"). ``after_timed(step, batches)``, when
    given, runs after the timed steps (e.g. a profile) and its return value is stored under "extra"."""
    import torch.distributed as dist

    started = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = resolve_device(exp)
    if exp["gpus"] != world:
        raise ValueError(f"the experiment asks for {exp['gpus']} GPU processes but runs in {world} (foak bench "
                         "launches several through torchrun)")
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    autocast = autocast_dtype(exp)
    if autocast == torch.float16 and device.type != "cuda":
        raise ValueError("precision fp16-autocast needs a CUDA GPU (no fp16 autocast with a GradScaler on CPU)")

    model, about = build_model(exp, device)
    vocab = model.config.vocab_size
    model, peft_note = apply_peft(model, exp, device)
    model.train()
    model, report = apply_framework(model, exp)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=exp["learning_rate"], fused=device.type == "cuda")
    scaler = torch.amp.GradScaler("cuda") if autocast == torch.float16 else None

    gen = torch.Generator(device=device).manual_seed(exp["seed"] + 1 + rank)
    make = packed_inputs if exp["packing"] else random_inputs
    batch, seq = exp["batch_size"], exp["seq_length"]
    warm = max(exp["warmup_steps"], 1)  # the first step is always timed apart (time to first step)
    n_steps = warm + exp["timed_steps"]
    batches = [make(batch, seq, vocab, gen, device) for _ in range(n_steps)]

    def step(inputs):
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(**inputs).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    losses = []
    sync()
    setup_s = time.perf_counter() - started
    first_start = time.perf_counter()
    losses.append(step(batches[0]))  # compilation / autotuning included
    sync()
    first_step_s = time.perf_counter() - first_start
    for inputs in batches[1:warm]:
        losses.append(step(inputs))
    sync()
    reset_peak_memory(device)
    timer = StepTimer(device)
    timed = batches[warm:]
    with SmiSampler(device) as smi:
        start = time.perf_counter()
        timer.mark()
        for inputs in timed:
            losses.append(step(inputs))
            timer.mark()
        sync()
        seconds = time.perf_counter() - start
    step_times = timer.step_ms()
    memory = peak_memory(device)
    extra = after_timed(step, timed) if after_timed is not None else None
    loss_values = [float(x) for x in losses]
    tokens_per_step = batch * seq * world
    if world > 1:  # the whole job's tokens/s over the slowest rank's time; the largest rank's memory
        stats = torch.tensor([seconds, memory["peak_allocated_gib"] or 0.0, memory["peak_reserved_gib"] or 0.0,
                              memory["peak_rss_gib"] or 0.0], dtype=torch.float64,
                             device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        seconds = float(stats[0])
        if memory["peak_allocated_gib"] is not None:
            memory["peak_allocated_gib"], memory["peak_reserved_gib"] = float(stats[1]), float(stats[2])
        memory["peak_rss_gib"] = float(stats[3])
        dist.destroy_process_group()
    n_timed = len(timed)
    result = {
        "status": "ok", "error": "", "rank": rank,
        "tokens_per_s": n_timed * tokens_per_step / seconds if n_timed else math.nan,
        "step_ms": seconds / n_timed * 1e3 if n_timed else math.nan,
        "step_ms_median": statistics.median(step_times) if step_times else math.nan,
        "step_ms_noise": relative_spread(step_times),
        "tokens_per_s_noise": relative_spread(step_times),
        **memory,
        "smi_peak_used_mib": smi.peak_used_mib, "smi_mean_utilization": smi.mean_utilization,
        "first_step_s": first_step_s, "setup_s": setup_s,
        "first_loss": loss_values[0] if loss_values else math.nan,
        "final_loss": loss_values[-1] if loss_values else math.nan,
        "tokens_per_step": tokens_per_step, "timed_steps_run": n_timed,
        "trainable_params": trainable, "total_params": total,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "weights_dtype": str(weights_dtype(exp, device)).removeprefix("torch."),
        "autocast": None if autocast is None else str(autocast).removeprefix("torch."),
        "model_about": about, "peft_note": peft_note,
        "losses": loss_values, "step_times_ms": step_times,
        "patch_report": None if report is None else str(report),  # after the steps: with call counts
        "extra": extra,
    }
    return result
