"""Whole training steps on the GPU: HF transformers vs foak (vs Liger when importable), each variant in
its own process so that peak memory is clean. Models are built from configs with random weights
(ANCHORS.md dims); input = random token ids, labels = inputs; bf16 weights, fused AdamW, sdpa. The models
(foak.bench.models) and the step loop (foak.bench.step.run_experiment) are foak bench's: `foak bench headline`
runs the same steps from a scenario file.

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
    --fsdp: FSDP2 with world size 1, so the FSDP2 code path runs on real kernels: each variant's process
            initialises a 1-rank process group itself (NCCL on CUDA, gloo on CPU; MASTER_ADDR / MASTER_PORT from
            the environment, else 127.0.0.1 and a free port; RANK=0, WORLD_SIZE=1) and, after the framework
            patched the model, shards it as accelerate's FSDP2 plugin does (foak.integrations.accelerate
            .shard_model: every decoder layer with reshard_after_forward, the final norm + lm_head as one unit
            kept gathered after the forward, the root); the optimizer then steps the DTensor parameters
    --packing-compare: each variant on the packed rows and on the same number of tokens unpacked, in one call
            (tokens/s and peak of packed vs unpacked per variant at the end); variants ``foak-nopack`` (every
            foak switch but fast_packed_attention: transformers' dense block-causal mask) and ``foak:BACKEND``
            (FOAK_PACKED_ATTENTION=BACKEND: flash, varlen_attn, flex, sdpa) can be added to --variants, or
            --packed-backends B ... adds foak:B for each
    python3 benchmarks/train_step.py --packing-compare --models llama1b llama8b-8l mixtral-small \
            --variants hf foak foak-nopack liger --out DIR     # issue [packing]'s rows in one call
    python3 benchmarks/train_step.py --one llama1b foak      # a single variant (what the driver runs)
    python3 benchmarks/train_step.py --models tiny --variants hf foak --device cpu --out /tmp/x  # smoke
    python3 benchmarks/train_step.py --models tiny --variants hf foak --device cpu --fsdp --out /tmp/x  # smoke
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

from foak.bench.measure import environment
from foak.bench.models import BUILTIN_MODELS
from foak.bench.step import run_experiment

# the models' shapes, batch sizes and sequence lengths: foak.bench.models (foak bench's built-in models)
MODELS = {name: (m.config_class, m.dims, m.batch_size, m.seq_length) for name, m in BUILTIN_MODELS.items()}
DEFAULT_MODELS = ["llama1b", "llama8b-8l", "mixtral-small", "tiny"]
WARMUP, TIMED = 3, 8


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


def switches_without_packed_attention(model_name: str, peft: str) -> dict:
    """foak-nopack: every switch foak has for the model (foak.api.default_config, read from the model built
    on the meta device) but fast_packed_attention; fused_lora with PEFT."""
    import transformers

    from foak.api import default_config

    spec = BUILTIN_MODELS[model_name]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, spec.config_class)(**spec.dims))
    config = default_config(model).model_dump(exclude={"mode", "base_layer"})
    switches = {k: True for k, v in config.items() if v is True}
    switches.pop("fast_packed_attention", None)
    if peft != "none":
        switches["fused_lora"] = True
    return switches


def experiment(model_name: str, variant: str, checkpointing: bool = False, packed: bool = False,
               device: str = "cuda", autocast: bool = False, lora: bool = False, qlora: bool = False,
               gptq: bool = False) -> dict:
    """This script's variant as a foak bench experiment (foak.bench.step runs both). Weights: bf16 on CUDA, fp32
    on CPU or with --autocast; PEFT runs put fp32 adapters under bf16 autocast."""
    model = BUILTIN_MODELS[model_name]
    peft = "qlora-nf4" if qlora else "gptq-lora" if gptq else "lora" if lora else "none"
    if device == "cuda":
        precision = "bf16-autocast" if autocast else "bf16"
    else:
        precision = "bf16-autocast" if autocast or peft != "none" else "fp32"
    base = variant.partition(":")[0]  # foak:flex = foak with FOAK_PACKED_ATTENTION=flex (set by run_one)
    kind = {"hf": "none", "foak": "foak", "foak-nopack": "foak", "liger": "liger"}[base]
    switches = switches_without_packed_attention(model_name, peft) if base == "foak-nopack" else None
    return {"scenario": "train_step", "experiment": f"{model_name}/{variant}", "point": model_name,
            "model": model_name, "framework": variant,
            "model_spec": {"builtin": model_name, "path": None, "hub": None, "init": "pretrained", "overrides": {},
                           "batch_size": None, "seq_length": None},
            # foak: every switch foak has for the model (foak.api.default_config; fused_lora with PEFT)
            "framework_spec": {"name": variant, "kind": kind, "config": None, "switches": switches, "options": {},
                               "callable": None, "requires": [], "env": {}},
            "batch_size": model.batch_size, "seq_length": model.seq_length, "packing": packed,
            "precision": precision, "peft": peft, "gradient_checkpointing": checkpointing, "gpus": 1,
            "warmup_steps": WARMUP, "timed_steps": TIMED, "seed": 0, "device": device,
            "lora_r": 16, "lora_alpha": 16, "lora_dropout": 0.0, "learning_rate": 1e-5, "attn_implementation": "sdpa",
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            "env": {}, "timeout_s": 1800}


def init_one_rank_group(device: str) -> None:
    """The world-size-1 process group FSDP2 needs: NCCL on CUDA, gloo on CPU."""
    import socket

    import torch.distributed as dist

    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def shard_after_framework(device: str) -> None:
    """--fsdp: foak.bench.step runs the step loop; its apply_framework (patch with foak / Liger / nothing) is
    wrapped, in this variant's own process only, so the patched model is then sharded by FSDP2."""
    import foak.bench.step as step_module
    from foak.integrations.accelerate import shard_model

    apply_framework = step_module.apply_framework

    def apply_then_shard(model, exp):
        model, report = apply_framework(model, exp)
        init_one_rank_group(device)
        return shard_model(model), report

    step_module.apply_framework = apply_then_shard


def run_one(model_name: str, variant: str, checkpointing: bool = False, packed: bool = False,
            device: str = "cuda", profile: bool = False, autocast: bool = False, lora: bool = False,
            qlora: bool = False, gptq: bool = False, fsdp: bool = False) -> dict:
    exp = experiment(model_name, variant, checkpointing, packed, device, autocast, lora, qlora, gptq)
    if variant.startswith("foak:"):  # this variant's own process: the packed-attention backend to use
        os.environ["FOAK_PACKED_ATTENTION"] = variant.partition(":")[2]
    if fsdp:
        shard_after_framework(device)

    def profiled(step, batches):
        try:
            return profile_steps(step, batches, 2)
        except Exception as err:  # the timing above stands; say why the profile is missing
            return {"error": f"{type(err).__name__}: {err}"}

    r = run_experiment(exp, after_timed=profiled if profile and device == "cuda" else None)
    return {"model": model_name, "variant": variant, "checkpointing": checkpointing, "packed": packed,
            "autocast": r["autocast"] is not None,
            "weights": "nf4" if qlora else "gptq4" if gptq else r["weights_dtype"],
            "lora": exp["peft"] != "none",
            "batch": exp["batch_size"], "seq": exp["seq_length"], "tokens_per_s": r["tokens_per_s"],
            "step_ms": r["step_ms"], "step_ms_median": r["step_ms_median"],
            "peak_gib": r["peak_allocated_gib"] if device == "cuda" else float("nan"),
            "peak_reserved_gib": r["peak_reserved_gib"], "first_step_s": r["first_step_s"], "losses": r["losses"],
            "patch_report": r["patch_report"],  # after the steps: with call counts
            "profile": r["extra"],
            "fsdp": "FSDP2, world size 1, foak.integrations.accelerate.shard_model" if fsdp else None}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--models", nargs="*", default=DEFAULT_MODELS, choices=list(MODELS))
    parser.add_argument("--variants", nargs="*", default=["hf", "foak", "liger"])
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (non-reentrant)")
    parser.add_argument("--packed", action="store_true", help="rows of packed variable-length sequences")
    parser.add_argument("--autocast", action="store_true", help="fp32 weights + bf16 autocast")
    parser.add_argument("--lora", action="store_true", help="PEFT LoRA r16 on every projection (bf16 base)")
    parser.add_argument("--qlora", action="store_true", help="PEFT LoRA r16 on a bitsandbytes NF4 base")
    parser.add_argument("--gptq", action="store_true", help="PEFT LoRA r16 on a foak GPTQ-4bit base")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard with world size 1 (see above)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the code paths (use --models tiny)")
    parser.add_argument("--lce-chunk-mib", type=int, default=0,
                        help="foak: linear_cross_entropy's chunk budget (default: its TUNING value)")
    parser.add_argument("--tag", default="", help="suffix of the result file name")
    parser.add_argument("--profile", action="store_true", help="also profile 2 steps: GPU time by kernel category")
    parser.add_argument("--moe-recompute", action="store_true",
                        help="foak: moe_experts recomputes the [S, 2I] gate/up product in the backward")
    parser.add_argument("--packing-compare", action="store_true",
                        help="each variant on packed rows and on the same tokens unpacked, in one call")
    parser.add_argument("--packed-backends", nargs="*", default=[],
                        help="add a foak:B variant per packed-attention backend B (flash, varlen_attn, flex, sdpa)")
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
                         gptq=args.gptq, fsdp=args.fsdp)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    flags = [f for f, on in (("--checkpointing", args.checkpointing), ("--packed", args.packed),
                             ("--autocast", args.autocast), ("--lora", args.lora), ("--qlora", args.qlora), ("--gptq", args.gptq), ("--fsdp", args.fsdp),
                             ("--profile", args.profile), ("--moe-recompute", args.moe_recompute)) if on]
    if args.lce_chunk_mib:
        flags += ["--lce-chunk-mib", str(args.lce_chunk_mib)]
    rows = []
    variants = [*args.variants, *(f"foak:{b}" for b in args.packed_backends)]
    packings = [True, False] if args.packing_compare else [args.packed]
    for model_name in args.models:
        for packed in packings:
            run_flags = [f for f in flags if f != "--packed"] + (["--packed"] if packed else [])
            for variant in variants:
                proc = subprocess.run([sys.executable, __file__, "--one", model_name, variant, *run_flags,
                                       "--device", args.device], capture_output=True, text=True, env=os.environ)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                    rows.append({"model": model_name, "variant": variant, "packed": packed, "error": " | ".join(tail)})
                else:
                    rows.append(json.loads(line[len("RESULT "):]))
                print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("patch_report", "profile")}),
                      flush=True)
    # the rows ran in their own processes: this one needs no CUDA context (environment's liger_kernel: None when
    # not installed, no liger rows either)
    result = {"environment": environment(init_cuda=False), "lce_chunk_mib": args.lce_chunk_mib or "default",
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "warmup_steps": WARMUP, "timed_steps": TIMED, "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    suffix = "_" + "_".join(args.models)  # one file per set of models: runs do not overwrite each other
    suffix += "".join(f"_{f.lstrip('-')}" for f in flags if f.startswith("--") and f not in ("--profile", "--lce-chunk-mib"))
    if args.packing_compare:
        suffix += "_packing_compare"
    if args.tag:
        suffix += f"_{args.tag}"
    (Path(args.out) / f"train_step_h200{suffix}.json").write_text(json.dumps(result, indent=1))
    print("| model | variant | packed | tokens/s | peak GiB | step ms | first step s | first losses |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['variant']} | {r.get('packed')} | error: {r['error'][:120]} | | | | |")
        else:
            print(f"| {r['model']} | {r['variant']} | {r['packed']} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} | "
                  f"{r['step_ms']:.0f} | {r['first_step_s']:.1f} | {', '.join(f'{x:.4f}' for x in r['losses'][:3])} |")
    if args.packing_compare:  # issue [packing]'s targets: packed within 3% of unpacked, peak no higher
        done = {(r["model"], r["variant"], r["packed"]): r for r in rows if "error" not in r}
        for (model_name, variant, packed), r in done.items():
            u = done.get((model_name, variant, False))
            if packed and u is not None:
                ratio = r["tokens_per_s"] / u["tokens_per_s"]
                print(f"{model_name} {variant}: packed / unpacked tokens/s {ratio:.3f}, "
                      f"peak {r['peak_gib']:.2f} vs {u['peak_gib']:.2f} GiB")
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
