"""TRL's preference and RL training steps on the GPU: DPO and GRPO, TRL alone vs TRL + Liger vs TRL + foak (issue [rl]).

    python3 benchmarks/rl.py --out $OUT                      # the check, then every timed row, the table last
    python3 benchmarks/rl.py --out $OUT --check-only         # the fp32 correctness check alone (6 processes)
    python3 benchmarks/rl.py --out $OUT --skip-check --trainers dpo --models llama1b   # 6 timed processes
    python3 benchmarks/rl.py --one dpo llama1b full foak     # one run (what the driver starts per process)
    TRITON_INTERPRET=1 python3 benchmarks/rl.py --cpu-smoke --out /tmp/rl   # tiny dims on CPU: the code paths only

The whole set is 6 check + 24 timed processes (each ~0.5-1 min with imports and the first step's compilation): to
stay under a 10-minute command, run --check-only once, then one (trainer, model) per command with --skip-check.
Each invocation writes its own JSON, named after its selection.

Every run (trainer, model, mode, variant) is its own process. Models: random weights from the built-in configs
(foak.bench.models: ``llama1b`` = Llama-3.2-1B dims, ``llama8b-8l`` = Llama-3-8B dims with 8 layers), no download.
Modes: ``full`` (every weight trained; DPO's reference model is a second copy, which foak patches too) and ``lora``
(PEFT LoRA r16 on every linear layer of the decoder; TRL 1.16's DPO keeps a frozen copy of the initial adapter,
named "ref", and switches to it for the reference forward).
Variants: ``trl`` (TRL alone), ``liger`` (``use_liger_kernel=True``: TRL 1.16 applies Liger's layer kernels, keeping
its own fused LM head), ``foak`` (``foak.patch`` with foak's defaults on the policy, and on DPO's reference model);
``foak-tiled`` (not run by default: the defaults + ``tiled_mlp``, the MLP in sequence chunks).

- DPO: 2 pairs per step, prompt 1024 + chosen 1024 and prompt 1024 + rejected 1024 tokens (2 x 2 sequences of 2048
  tokens = 8192 tokens per step through the policy, and as many through the reference model).
- GRPO: one prompt of 512 tokens with 8 completions of 1536 tokens each per step (8 x 2048 = 16384 tokens), taken
  from a fixed completions fixture through TRL's ``rollout_func``, so generation is excluded from the step;
  a stub reward; TRL's GRPO defaults otherwise (beta 0: no reference model; ``--grpo-beta 0.04`` adds one, which
  TRL loads from the policy saved to a temporary directory under full FT, and which foak patches too).
TRL's defaults otherwise (bf16 autocast, gradient checkpointing); bf16 weights, fused AdamW, lr 1e-6; 2 warm-up and
5 timed steps; tokens/s counts the policy's tokens (prompt + completion) of the timed steps; peak memory is
torch.cuda.max_memory_allocated over the timed steps.

First a correctness check: each trainer for 2 steps in fp32 (2 layers of Llama-1B dims, 256-token sequences, full
FT, SGD at lr 0.1: Adam's first step moves every weight by about lr whatever its gradient's size, so gradients that
differ by rounding near 0 would move weights by +-lr and step 2 would compare noise), every variant in its own
process; every metric TRL logged (loss, rewards, log-probs, entropy, grad_norm, ...) must agree with TRL alone
within 1e-4 relative (+1e-5 absolute for differences of log-probs). Each timed row also records its step-1 metrics
and their largest relative distance from TRL alone's (bf16: for reading, not a pass/fail).
Each row counts the calls of TRL's own fused-head kernel and the calls foak served (the fused_linear_loss rows).

Writes ``rl_<gpu>[_check]_<trainers>_<models>_<modes>.json`` (gpu: h200, h100, ...; ``rl_smoke.json`` with
--cpu-smoke): environment, check rows, timed rows; prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

TRAINERS, MODES, VARIANTS = ("dpo", "grpo"), ("full", "lora"), ("trl", "liger", "foak", "foak-tiled")
DEFAULT_VARIANTS = ("trl", "liger", "foak")
MODELS = ("llama1b", "llama8b-8l")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# sequence shapes: (prompt tokens, completion tokens); DPO pairs per step, GRPO completions per prompt
SHAPES = {"bench": {"dpo": (1024, 1024), "grpo": (512, 1536)}, "check": {"dpo": (128, 128), "grpo": (64, 192)},
          "smoke": {"dpo": (12, 12), "grpo": (8, 16)}}
DPO_PAIRS, GRPO_COMPLETIONS = 2, 8
WARMUP, TIMED = 2, 5
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "epoch"}
CHECK_RTOL, CHECK_ATOL = 1e-4, 1e-5
SERVED = re.compile(r"served TRL's fused LM head \((\d+) calls?\)")
FALLBACK = re.compile(r"TRL's own kernel ran (\d+) calls?")


def _foak_patch(model, variant: str, precision: str):
    """foak.patch with foak's defaults; ``foak-tiled``: the defaults + ``tiled_mlp`` (the MLP in sequence chunks,
    forward and recompute: no whole [tokens, intermediate] tensor)."""
    import foak
    from foak.api import default_config

    extra = {"tiled_mlp": True} if variant == "foak-tiled" else {}
    return foak.patch(model, default_config(model, **extra), mixed_precision=precision)


def _model(name: str, kind: str, device: str, dtype):
    import torch
    import transformers

    from foak.bench.models import BUILTIN_MODELS

    overrides = {"num_hidden_layers": 2} if kind == "check" else {}
    config = BUILTIN_MODELS["tiny" if kind == "smoke" else name].config(**overrides)
    config._attn_implementation = "sdpa"
    config.max_position_embeddings = max(config.max_position_embeddings, 4096)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def _text(rng: random.Random, n: int, alphabet: str) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def one_run(trainer_name: str, model_name: str, mode: str, variant: str, kind: str, grpo_beta: float = 0.0,
            profile: bool = False) -> dict:
    """One process: build, patch, train WARMUP + TIMED steps (2 for the check), return the record. ``profile``:
    the last step also runs under torch.profiler (its kernels' device time, summed by name, in the record)."""
    import datasets
    import peft
    import torch
    import transformers
    import trl
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from foak.bench.measure import GemmLayouts, gemm_shapes, kernel_times, peak_memory, reset_peak_memory
    from foak.data import DEFAULT_CHARS, char_tokenizer

    device = "cpu" if kind == "smoke" else "cuda"
    bf16 = kind == "bench"
    dtype = torch.bfloat16 if bf16 else torch.float32
    steps = (2 if kind != "bench" else WARMUP + TIMED) + (1 if profile else 0)  # + the profiled step
    warmup = 0 if kind != "bench" else WARMUP
    prompt_len, completion_len = SHAPES[kind][trainer_name]
    tokenizer = char_tokenizer()
    alphabet = "".join(c for c in DEFAULT_CHARS if c.isalnum())  # one token per character, no special tokens
    rng = random.Random(7)

    trl_calls = [0]
    forward = ChunkedLogProbFunction.forward

    def counting(*args, **kwargs):
        trl_calls[0] += 1
        return forward(*args, **kwargs)

    ChunkedLogProbFunction.forward = staticmethod(counting)

    model = _model(model_name, kind, device, dtype)
    ref_model = None
    if trainer_name == "dpo" and mode == "full":
        ref_model = _model(model_name, kind, device, dtype)  # same seed: the same weights
    if trainer_name == "grpo" and grpo_beta > 0 and mode == "full":
        # GRPO loads its reference model from the policy's path: the random weights go to a local directory
        import tempfile

        path = tempfile.mkdtemp(prefix="rl_bench_policy_")
        model.save_pretrained(path)
        model.config._name_or_path = path
    if mode == "lora":
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=LORA_TARGETS,
                                                           lora_dropout=0.0))
    reports = {}
    if variant.startswith("foak"):
        import foak

        if kind == "smoke":  # the code paths only: foak's torch reference ops (the kernels have their own tests)
            foak.set_backend("reference")
        precision = "bf16" if bf16 else "no"
        reports["policy"] = _foak_patch(model, variant, precision)
        if ref_model is not None:
            reports["reference"] = _foak_patch(ref_model, variant, precision)

    step_times, kernels, gemms, layouts = [], [], [], []

    class Timer(transformers.TrainerCallback):
        profiler = None

        def on_step_begin(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            if state.global_step == warmup:
                reset_peak_memory(device)
            if profile and state.global_step == steps - 1:  # the last step (its time is not counted)
                activities = [torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
                self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
                self.profiler.__enter__()
                self.layouts = GemmLayouts().__enter__()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            if self.profiler is not None:
                self.layouts.__exit__(None, None, None)
                layouts.extend(self.layouts.rows())
                self.profiler.__exit__(None, None, None)
                kernels.extend(kernel_times(self.profiler, cpu=device != "cuda"))
                gemms.extend(gemm_shapes(self.profiler))
                self.profiler = None
                return
            step_times.append(time.perf_counter() - self.t0)

    common = dict(output_dir=f"/tmp/rl_bench_{os.getpid()}", max_steps=steps, learning_rate=1e-6 if bf16 else 0.1,
                  optim="adamw_torch_fused" if bf16 else "sgd", report_to="none", save_strategy="no",
                  logging_steps=1, bf16=bf16, seed=3, dataloader_num_workers=0, use_liger_kernel=variant == "liger",
                  lr_scheduler_type="constant")
    if trainer_name == "dpo":
        n = DPO_PAIRS * steps
        # the char tokenizer: one token per character; TRL appends EOS to each completion
        data = {"prompt": [_text(rng, prompt_len, alphabet) for _ in range(n)],
                "chosen": [_text(rng, completion_len - 1, alphabet) for _ in range(n)],
                "rejected": [_text(rng, completion_len - 1, alphabet) for _ in range(n)]}
        config = trl.DPOConfig(per_device_train_batch_size=DPO_PAIRS, max_length=prompt_len + completion_len,
                               dataset_num_proc=None, **common)
        trainer = trl.DPOTrainer(model=model, ref_model=ref_model, args=config,
                                 train_dataset=datasets.Dataset.from_dict(data), processing_class=tokenizer,
                                 callbacks=[Timer()])
        tokens_per_step = DPO_PAIRS * 2 * (prompt_len + completion_len)
    else:
        # the completions fixture: per prompt, GRPO_COMPLETIONS fixed token sequences (no generation in the step)
        prompts = [f"prompt {i}" for i in range(steps)]
        vocab = [tokenizer.convert_tokens_to_ids(c) for c in alphabet]
        fixture = {p: ([rng.choice(vocab) for _ in range(prompt_len)],
                       [[rng.choice(vocab) for _ in range(completion_len)] for _ in range(GRPO_COMPLETIONS)])
                   for p in prompts}

        def rollout(batch_prompts, trainer):
            # TRL 1.16 passes each prompt once per completion (its sampler repeats them): the k-th occurrence of a
            # prompt gets the fixture's k-th completion
            out, seen = {"prompt_ids": [], "completion_ids": [], "logprobs": None}, {}
            for p in batch_prompts:
                prompt_ids, completions = fixture[p]
                k = seen[p] = seen.get(p, -1) + 1
                out["prompt_ids"].append(prompt_ids)
                out["completion_ids"].append(completions[k % len(completions)])
            return out

        def reward(completions, **kwargs):  # a stub with spread inside each group
            return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]

        os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
        config = trl.GRPOConfig(per_device_train_batch_size=GRPO_COMPLETIONS, num_generations=GRPO_COMPLETIONS,
                                max_completion_length=completion_len, beta=grpo_beta, **common)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=config,
                                  train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                                  processing_class=tokenizer, rollout_func=rollout, callbacks=[Timer()])
        if variant.startswith("foak") and trainer.ref_model is not None:  # the trainer's own reference model
            reports["reference"] = _foak_patch(trainer.ref_model, variant, "bf16" if bf16 else "no")
        tokens_per_step = GRPO_COMPLETIONS * (prompt_len + completion_len)
    trainer.train()
    timed = step_times[warmup:]
    logs = [{k: v for k, v in entry.items() if k not in TIMINGS and isinstance(v, (int, float))}
            for entry in trainer.state.log_history if "grad_norm" in entry]
    record = {"trainer": trainer_name, "model": model_name, "mode": mode, "variant": variant, "kind": kind,
              "grpo_beta": grpo_beta if trainer_name == "grpo" else None,
              "tokens_per_step": tokens_per_step, "steps": steps, "timed_steps": len(timed),
              "tokens_per_s": tokens_per_step * len(timed) / sum(timed) if timed else None,
              "step_ms": 1e3 * sum(timed) / len(timed) if timed else None,
              "peak_gib": peak_memory(device)["peak_allocated_gib"] if device == "cuda" else None,
              "metrics": logs, "trl_kernel_calls": trl_calls[0]}
    if profile:
        record["profile"] = kernels
        record["profile_gemms"] = gemms
        record["profile_gemm_layouts"] = layouts
    for role, report in reports.items():
        notes = report.result(f"{report.model_type}.fused_linear_loss").notes
        served, fallback = SERVED.search(notes), [int(x) for x in FALLBACK.findall(notes)]
        record[f"foak_served_{role}"] = int(served.group(1)) if served else 0
        record[f"foak_fallback_{role}"] = sum(fallback)
        record[f"report_{role}"] = str(report)
    return record


# counts of comparisons between near-equal numbers (DPO's step 1: policy == reference, every reward ~0): they flip
# on rounding, so they are recorded but not compared
DISCRETE = {"step", "rewards/accuracies"}


def _distance(metrics, ref_metrics) -> tuple[float, str]:
    """The largest |a - b| / (|b| + atol/rtol) over the metrics both logged, and its key (step:key)."""
    worst, where = 0.0, ""
    for step, (logged, ref) in enumerate(zip(metrics, ref_metrics), 1):
        for key, want in ref.items():
            if key in logged and key not in DISCRETE:
                d = abs(logged[key] - want) / (abs(want) + CHECK_ATOL / CHECK_RTOL)
                if not math.isfinite(logged[key]) or d > worst:
                    worst, where = (math.inf if not math.isfinite(logged[key]) else d), f"{step}:{key}"
    return worst, where


def _spawn(args: list[str], timeout: float, grpo_beta: float, profile: bool = False) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--one", *args, "--grpo-beta", str(grpo_beta)] + (
        ["--profile"] if profile else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"))
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout} s"}
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:] or ["no output"]
        return {"error": " | ".join(tail)[:400]}
    return json.loads(line[len("RESULT "):])


def _environment() -> dict:
    import importlib.metadata as md

    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for package in ("torch", "triton", "transformers", "trl", "peft", "liger-kernel", "foak"):
        try:
            env[package] = md.version(package)
        except md.PackageNotFoundError:
            env[package] = None
    try:
        import torch

        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as error:  # noqa: BLE001 (a record, not a failure)
        env["gpu"] = f"unknown: {error}"
    return env


def _short(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("report_", "profile")) and k != "metrics"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny dims on the CPU (liger left out)")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per process")
    parser.add_argument("--one", nargs=4, metavar=("TRAINER", "MODEL", "MODE", "VARIANT"))
    parser.add_argument("--kind", default="bench", choices=("bench", "check", "smoke"))
    parser.add_argument("--grpo-beta", type=float, default=0.0,
                        help="GRPO's KL coefficient (TRL's default 0: no reference model); > 0 adds the reference "
                             "model's forward (full FT: TRL loads it from the policy saved to a temporary directory)")
    parser.add_argument("--profile", action="store_true",
                        help="timed rows: one more step under torch.profiler, its kernels in the JSON and the log")
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_run(*args.one, args.kind, args.grpo_beta, args.profile)), flush=True)
        return 0

    smoke = args.cpu_smoke
    variants = [v for v in args.variants if not (smoke and v == "liger")]
    models = args.models[:1] if smoke else args.models  # smoke: one tiny model stands for all
    checks = []
    if not args.skip_check:  # 1. correctness first: fp32, 2 steps, every variant vs TRL alone
        for trainer in args.trainers:
            ref = None
            for variant in variants:
                record = _spawn([trainer, "llama1b", "full", variant, "--kind", "smoke" if smoke else "check"],
                                args.timeout, args.grpo_beta)
                record.update(trainer=trainer, variant=variant, kind="check")
                if variant == "trl":
                    ref = record
                if "error" not in record and ref is not None and "error" not in ref:
                    record["distance"], record["worst"] = _distance(record["metrics"], ref["metrics"])
                    record["ok"] = record["distance"] <= CHECK_RTOL and (
                        not variant.startswith("foak") or record["trl_kernel_calls"] == 0)
                else:
                    record["ok"] = False
                checks.append(record)
                print("CHECK " + json.dumps(_short(record)), flush=True)
    rows = []
    for trainer in args.trainers if not args.check_only else []:  # 2. the timed runs
        for model in models:
            for mode in args.modes:
                ref = None
                for variant in variants:
                    record = _spawn([trainer, model, mode, variant, "--kind", "smoke" if smoke else "bench"],
                                    args.timeout, args.grpo_beta, args.profile)
                    record.update(trainer=trainer, model=model, mode=mode, variant=variant)
                    if variant == "trl":
                        ref = record
                    if "error" not in record and ref is not None and "error" not in ref:
                        record["step1_distance"], record["step1_worst"] = _distance(record["metrics"][:1],
                                                                                    ref["metrics"][:1])
                        record["speedup"] = record["tokens_per_s"] / ref["tokens_per_s"]
                        if record.get("peak_gib") and ref.get("peak_gib"):
                            record["memory_ratio"] = record["peak_gib"] / ref["peak_gib"]
                    rows.append(record)
                    print("ROW " + json.dumps(_short(record)), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    selection = "_".join("-".join(x) for x in (args.trainers, args.models, args.modes))
    selection += f"_grpo-beta{args.grpo_beta:g}" if args.grpo_beta and "grpo" in args.trainers else ""
    environment = _environment()
    from foak.bench.measure import gpu_tag

    gpu = gpu_tag(environment.get("gpu"))
    name = "rl_smoke" if smoke else (f"rl_{gpu}_check_" + "-".join(args.trainers) if args.check_only
                                     else f"rl_{gpu}_" + selection)
    path = Path(args.out) / f"{name}.json"
    path.write_text(json.dumps({"environment": environment, "checks": checks, "rows": rows}, indent=1))
    print(f"wrote {path}")
    print("| check | variant | ok | largest distance from TRL alone (step:metric) | TRL kernel calls | foak served |")
    print("|---|---|---|---|---|---|")
    for r in checks:
        served = r.get("foak_served_policy", "") if r["variant"].startswith("foak") else ""
        distance = r.get("error") or "{:.1e} ({})".format(r.get("distance", 0.0), r.get("worst", ""))
        print(f"| {r['trainer']} fp32 | {r['variant']} | {'yes' if r['ok'] else 'NO'} | {distance} | "
              f"{r.get('trl_kernel_calls', '')} | {served} |")
    print("\n| trainer | model | mode | variant | tokens/s | x TRL | peak GiB | x TRL | step-1 distance | "
          "TRL kernel calls | foak served (policy/ref) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['trainer']} | {r['model']} | {r['mode']} | {r['variant']} | error: {r['error'][:160]} "
                  "| | | | | | |")
            continue
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
        served = (f"{r.get('foak_served_policy', 0)}/{r.get('foak_served_reference', '-')}"
                  if r["variant"].startswith("foak") else "")
        print(f"| {r['trainer']} | {r['model']} | {r['mode']} | {r['variant']} | {r['tokens_per_s']:.0f} | "
              f"{r.get('speedup', float('nan')):.2f} | {peak} | {r.get('memory_ratio', float('nan')):.2f} | "
              f"{r.get('step1_distance', float('nan')):.1e} | {r['trl_kernel_calls']} | {served} |")
    for r in rows:
        if r.get("profile"):
            print(f"\nprofiled step, {r['trainer']} {r['model']} {r['mode']} {r['variant']}: kernel | calls | ms")
            for k in r["profile"][:16]:
                print(f"| {k['name'][:90]} | {k['calls']} | {k['ms']:.2f} |")
            if r.get("profile_gemms"):
                print("matrix products: op | input shapes | strides | calls | ms")
                for k in r["profile_gemms"][:16]:
                    print(f"| {k['name']} | {k['shapes']} | {k['strides']} | {k['calls']} | {k['ms']:.2f} |")
            if r.get("profile_gemm_layouts"):
                print("matrix product layouts: op | input shapes | strides | 128-byte aligned | calls")
                for k in r["profile_gemm_layouts"]:
                    print(f"| {k['name']} | {k['shapes']} | {k['strides']} | {k['aligned']} | {k['calls']} |")
    return 0 if all(r["ok"] for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
