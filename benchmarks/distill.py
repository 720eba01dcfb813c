"""TRL's DistillationTrainer training step on the GPU: TRL alone vs TRL + foak, each variant in its own process.

Student: Llama-3-8B dims with 8 layers (foak.bench.models "llama8b-8l"); teacher: Llama-3.2-1B dims ("llama1b");
random bf16 weights, no download. The step is TRL's own: ``trainer.compute_loss`` (student and teacher backbones,
then TRL's chunked distillation loss ``_chunked_divergence_loss``, which foak serves with ``linear_jsd`` when the
student is foak-patched), ``backward``, fused AdamW. Generation is left out: every step scores the same kind of
fixed random prompt + completion batch (the last 1/8 of every other completion masked, as after an early EOS).

First the loss alone (own process): foak's linear_jsd against TRL's ChunkedDivergenceFunction on the same head
shapes and scored tokens, for beta 0, 0.5 and 1 (temperature 0.9, student softcap 30): loss, entropy and
gradients must agree (relative errors: loss/entropy 1e-3, gradients 2e-2 in bf16), and each one's fwd+bwd time
and peak extra memory are recorded. Then a check: each variant computes the loss, TRL's logged entropy and the
student's grad norm of one step on the same weights and batch (own process); foak's must agree with TRL alone
(bf16: loss and entropy within 1e-2 relative, grad norm within 2e-2) and must have served the loss (its report
row says so). Then each variant is timed in its own process: tokens/s (prompt + completion tokens through the
student per second; batch 4 x (256 prompt + 1792 completion) tokens) and peak memory (torch's max allocated over
the timed steps, weights and optimizer state included). A short table comes last; the JSON goes to ``--out``
(default $OUT, else benchmarks/results). The timed phase runs only when every check passed (exit status 1 else).

    python3 benchmarks/distill.py                                   # the H200 run (all phases, a few minutes)
    python3 benchmarks/distill.py --setting tiny --device cpu --out /tmp/x    # CPU smoke test
    options: --variants trl foak [foak-teacher]   (foak-teacher: the teacher foak-patched too)
             --beta 0.5 --temperature 1.0 --checkpointing (TRL's default; off here: see below) --steps 8 --warmup 2
    (--one VARIANT|op [--check]: one variant, or the loss alone, in this process: what the driver runs)

Gradient checkpointing is off by default (DistillationConfig turns it on): it reruns the student's backbone in the
backward for both variants alike; --checkpointing measures that setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SETTINGS = {  # student, teacher, batch, prompt length, completion length
    "8b-8l": ("llama8b-8l", "llama1b", 4, 256, 1792),
    "tiny": ("tiny", "tiny", 2, 16, 24),
}
TINY_TEACHER = dict(hidden_size=32, intermediate_size=48, head_dim=8)  # narrower than the tiny student
VARIANTS = ("trl", "foak", "foak-teacher")
ROW = "llama.fused_linear_loss"


def _models(setting: str, device: torch.device, dtype: torch.dtype):
    import transformers

    from foak.bench.models import BUILTIN_MODELS

    student_name, teacher_name = SETTINGS[setting][:2]
    models = []
    for seed, name, overrides in ((0, student_name, {}), (1, teacher_name, TINY_TEACHER if setting == "tiny" else {})):
        torch.manual_seed(seed)
        config = BUILTIN_MODELS[name].config(**overrides)
        config._attn_implementation = "sdpa"
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.config.use_cache = False
        models.append(model)
    return models


def _batch(setting: str, vocab: int, device: torch.device, seed: int = 7) -> dict:
    _, _, batch, prompt, completion = SETTINGS[setting]
    gen = torch.Generator().manual_seed(seed)
    completion_mask = torch.ones(batch, completion, dtype=torch.long)
    completion_mask[1::2, completion - completion // 8:] = 0  # ended early (EOS) in every other row
    inputs = {"prompt_ids": torch.randint(3, vocab, (batch, prompt), generator=gen),
              "prompt_mask": torch.ones(batch, prompt, dtype=torch.long),
              "completion_ids": torch.randint(3, vocab, (batch, completion), generator=gen),
              "completion_mask": completion_mask}
    inputs = {k: v.to(device) for k, v in inputs.items()}
    inputs["num_items_in_batch"] = completion_mask.sum().float().to(device)
    return inputs


def run_one(variant: str, args) -> dict:
    import datasets
    import trl

    import foak
    from foak.bench.measure import environment, peak_memory, reset_peak_memory
    from foak.data import char_tokenizer

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    student, teacher = _models(args.setting, device, dtype)
    report = foak.patch(student) if variant.startswith("foak") else None
    teacher_report = foak.patch(teacher) if variant == "foak-teacher" else None
    if args.checkpointing:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    student.train()
    with tempfile.TemporaryDirectory() as out:
        config = trl.DistillationConfig(
            output_dir=out, report_to="none", save_strategy="no", bf16=False, use_cpu=device.type == "cpu",
            gradient_checkpointing=args.checkpointing, beta=args.beta, temperature=args.temperature,
            per_device_train_batch_size=SETTINGS[args.setting][2], max_completion_length=SETTINGS[args.setting][4])
        trainer = trl.DistillationTrainer(model=student, teacher_model=teacher, args=config,
                                          train_dataset=datasets.Dataset.from_dict({"prompt": ["unused"]}),
                                          processing_class=char_tokenizer())
    inputs = _batch(args.setting, student.config.vocab_size, device)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-6, fused=device.type == "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(update=True):
        loss = trainer.compute_loss(student, inputs)
        loss.backward()
        norm = None
        if not update:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in student.parameters()
                                                         if p.grad is not None])).item()
        if update:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach(), norm

    result = {"variant": variant, "setting": args.setting, "beta": args.beta, "temperature": args.temperature,
              "checkpointing": args.checkpointing, "device": str(device)}
    if args.check:
        loss, norm = step(update=False)
        result.update(loss=loss.item(), grad_norm=norm, entropy=trainer._metrics["train"]["entropy"][-1])
    else:
        _, _, batch, prompt, completion = SETTINGS[args.setting]
        for _ in range(args.warmup):
            step()
        sync()
        reset_peak_memory(device)
        start = time.perf_counter()
        losses = [step()[0] for _ in range(args.steps)]
        sync()
        seconds = time.perf_counter() - start
        scored = int(inputs["completion_mask"].sum())
        result.update(step_ms=1000 * seconds / args.steps, tokens_per_s=batch * (prompt + completion) * args.steps
                      / seconds, scored_tokens_per_s=scored * args.steps / seconds,
                      losses=[x.item() for x in losses], **peak_memory(device), environment=environment())
    if report is not None:
        result["patch_report"] = str(report)
        result["served_note"] = report.result(ROW).notes
    if teacher_report is not None:
        result["teacher_patch_report"] = str(teacher_report)
    return result


OP_TOL = {"loss": 1e-3, "entropy": 1e-3, "student_hidden": 2e-2, "student_weight": 2e-2}


def run_op(args) -> dict:
    """The loss alone: foak's linear_jsd vs TRL's ChunkedDivergenceFunction (what _chunked_divergence_loss runs)
    on the setting's student/teacher head shapes and scored tokens, bf16 on CUDA: per beta, loss, entropy and
    gradients against TRL's, and fwd+bwd time and peak extra memory of each."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    from foak.bench.measure import environment, event_median_ms, peak_extra_mib
    from foak.bench.models import BUILTIN_MODELS
    from foak.ops.linear_jsd import linear_jsd
    from foak.testing import relative_error

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    student_name, teacher_name, batch, _, completion = SETTINGS[args.setting]
    dims_s = BUILTIN_MODELS[student_name].dims
    dims_t = {**BUILTIN_MODELS[teacher_name].dims, **(TINY_TEACHER if args.setting == "tiny" else {})}
    n, vocab = batch * completion, dims_s["vocab_size"]
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    hs, ht = randn(n, dims_s["hidden_size"]), randn(n, dims_t["hidden_size"])
    ws = randn(vocab, dims_s["hidden_size"], scale=2 / dims_s["hidden_size"] ** 0.5).requires_grad_()
    wt = randn(vocab, dims_t["hidden_size"], scale=2 / dims_t["hidden_size"] ** 0.5)
    temperature, softcap = 0.9, 30.0
    runs = []
    for beta in (0.0, 0.5, 1.0):
        def trl_step():
            h = hs.detach().requires_grad_()
            div, ent = ChunkedDivergenceFunction.apply(h, ws, None, ht, wt, None, beta, temperature, 1.0, softcap,
                                                       1.0, None)
            loss = div.sum() / n
            grads = torch.autograd.grad(loss, [h, ws])
            return loss.detach(), ent.mean(), grads

        def foak_step():
            h = hs.detach().requires_grad_()
            loss, ent = linear_jsd(h, ws, ht, wt, beta=beta, temperature=temperature, student_softcap=softcap,
                                   return_entropy=True)
            grads = torch.autograd.grad(loss, [h, ws])
            return loss.detach(), ent, grads

        row = {"beta": beta}
        outputs = {}
        for name, step in (("trl", trl_step), ("foak", foak_step)):
            if device.type == "cuda":
                row[f"{name}_peak_extra_mib"], outputs[name] = peak_extra_mib(step, device)
                row[f"{name}_ms"] = event_median_ms(step, reps=5, warmup=2)
            else:
                outputs[name] = step()
        (loss, ent, (dh, dw)), (ref_loss, ref_ent, (ref_dh, ref_dw)) = outputs["foak"], outputs["trl"]
        row.update(loss=(loss.item(), ref_loss.item()), entropy=(ent.item(), ref_ent.item()),
                   errors={"loss": relative_error(loss, ref_loss), "entropy": relative_error(ent, ref_ent),
                           "student_hidden": relative_error(dh, ref_dh), "student_weight": relative_error(dw, ref_dw)})
        row["ok"] = all(row["errors"][k] <= tol for k, tol in OP_TOL.items())
        runs.append(row)
        del outputs
    return {"variant": "op", "tokens": n, "vocab": vocab, "temperature": temperature, "student_softcap": softcap,
            "runs": runs, "environment": environment()}


def _child(variant: str, args, check: bool) -> dict:
    flags = ["--one", variant, "--setting", args.setting, "--device", args.device, "--beta", str(args.beta),
             "--temperature", str(args.temperature), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    flags += ["--check"] if check else []
    flags += ["--checkpointing"] if args.checkpointing else []
    proc = subprocess.run([sys.executable, __file__, *flags], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"variant": variant, "error": f"rc {proc.returncode}: {proc.stderr[-3000:]}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="8b-8l")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["trl", "foak"])
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    parser.add_argument("--one", choices=[*VARIANTS, "op"])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.one:
        result = run_op(args) if args.one == "op" else run_one(args.one, args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    from foak.bench.measure import CheckLog

    variants = ["trl", *[v for v in args.variants if v != "trl"]]
    checks, rows = CheckLog(), {}
    op = _child("op", args, check=False)
    for run in op.get("runs", []):
        checks.check(f"op beta={run['beta']:g}: linear_jsd vs TRL's ChunkedDivergenceFunction (relative errors)",
                      run["ok"], **run["errors"])
    if "error" in op:
        checks.check("op: ran", False, error=op["error"])
    ref = _child("trl", args, check=True)
    checks.check("trl: check step ran", "error" not in ref, error=ref.get("error"))
    for variant in variants[1:]:
        got = _child(variant, args, check=True)
        ok = "error" not in got and "error" not in ref
        numbers = {"error": got.get("error")} if not ok else {}
        if ok:
            tol = {"loss": 1e-2, "entropy": 1e-2, "grad_norm": 2e-2} if args.device.startswith("cuda") else \
                {"loss": 1e-5, "entropy": 1e-5, "grad_norm": 1e-4}
            for key, rtol in tol.items():
                numbers[key] = (got[key], ref[key])
                ok &= abs(got[key] - ref[key]) <= rtol * abs(ref[key])
            numbers["served"] = got.get("served_note")
            ok &= "served TRL's distillation loss (1 call)" in (got.get("served_note") or "")
        checks.check(f"{variant}: step-1 loss, entropy, grad norm vs TRL alone; foak served the loss", ok, **numbers)
    if checks.all_ok:
        for variant in variants:
            rows[variant] = _child(variant, args, check=False)
            checks.check(f"{variant}: timed", "error" not in rows[variant], error=rows[variant].get("error"))
    from foak.bench.measure import environment, gpu_tag

    env = environment()
    result = {"environment": env, "setting": args.setting, "student": SETTINGS[args.setting][0],
              "teacher": SETTINGS[args.setting][1], "batch": SETTINGS[args.setting][2:], "checks": checks, "op": op,
              "runs": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_checkpointing" if args.checkpointing else ""
    name = f"distill_{gpu_tag(env.get('gpu'))}_{args.setting}_beta{args.beta:g}{suffix}.json"
    (out / name).write_text(json.dumps(result, indent=1))
    base = rows.get("trl", {}).get("tokens_per_s")
    print(f"\n{checks.summary()}; {out / name}")
    for run in op.get("runs", []):
        if "trl_ms" in run:
            print(f"loss alone, beta {run['beta']:g}: TRL {run['trl_ms']:.1f} ms, {run['trl_peak_extra_mib']:.0f} MiB; "
                  f"foak {run['foak_ms']:.1f} ms, {run['foak_peak_extra_mib']:.0f} MiB "
                  f"({run['trl_ms'] / run['foak_ms']:.2f}x)")
    print(f"{'variant':14} {'tokens/s':>10} {'vs trl':>7} {'step ms':>9} {'peak GiB':>9}")
    for variant, row in rows.items():
        if "error" in row:
            print(f"{variant:14} error")
            continue
        peak = row.get("peak_allocated_gib")
        print(f"{variant:14} {row['tokens_per_s']:10.0f} {row['tokens_per_s'] / base if base else 0:7.2f} "
              f"{row['step_ms']:9.1f} {peak if peak is not None else float('nan'):9.2f}")
    return 0 if checks.all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
