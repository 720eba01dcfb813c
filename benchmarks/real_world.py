"""The losses and a TRL training step in the setups users run, on the GPU (issue [real-world]).

    python3 benchmarks/real_world.py checks --out DIR     # loss features vs torch eager / fp64 on CUDA, + timings
    python3 benchmarks/real_world.py model --out DIR      # a patched Llama: compile (Inductor), save_on_cpu, report
    python3 benchmarks/real_world.py trl --out DIR [--variants trl liger foak] [--model llama1b]
    python3 benchmarks/real_world.py trl --one llama1b foak   # one variant (what the driver runs)
    TRITON_INTERPRET=1 python3 benchmarks/real_world.py checks --device cpu --out /tmp/x   # CPU smoke

`checks` writes DIR/real_world_checks_h200.json: fp32 gradient precision at logits of +-1e4 and +1e4 offset
(foak's error vs torch eager's, both against fp64), fp16 gradients with a loss scale (fraction of zero
entries vs an HF-style fp32 loss), the fused loss under bf16 autocast over fp32 weights (vs nn.Linear +
fp32 loss under autocast, and its fwd+bwd time), fp32 weight-gradient accumulation of a bf16 weight (the
cuBLAS fp32-output GEMM path), per-class weights, token accuracy and entropy, precompute_row_grad.
`trl` times a TRL SFTTrainer run (TRL's defaults: bf16 autocast, gradient checkpointing; bf16 weights,
fused AdamW, 3 warm-up + 8 timed steps) of TRL alone, TRL + Liger (use_liger_kernel=True) and TRL + foak
(foak.patch before the trainer), each in its own process, and counts foak's fused-loss calls per step.
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
import torch.nn.functional as F

from foak.bench.measure import CheckLog, environment, peak_memory, reset_peak_memory
from foak.bench.measure import event_median_ms as timed_ms  # CUDA-event median


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


def run_checks(device: str) -> list[dict]:
    from foak.ops.cross_entropy import cross_entropy
    from foak.ops.linear_cross_entropy import linear_cross_entropy

    small = device == "cpu"
    rows = CheckLog()
    record = rows.check

    torch.manual_seed(0)
    n, v = (16, 1031) if small else (512, 32768)
    # 1. fp32 precision at large logits
    for kind in ("pm1e4", "offset1e4"):
        x = ((torch.rand(n, v, device=device, dtype=torch.float64) * 2 - 1) * 1e4 if kind == "pm1e4"
             else torch.randn(n, v, device=device, dtype=torch.float64) * 3 + 1e4).float()
        t = torch.randint(0, v, (n,), device=device)
        grads = {}
        for name, fn, dt in (("fp64", F.cross_entropy, torch.float64), ("torch", F.cross_entropy, torch.float32),
                             ("foak", cross_entropy, torch.float32)):
            leaf = x.to(dt).clone().requires_grad_()
            fn(leaf, t).backward()
            grads[name] = leaf.grad
        e_torch, e_foak = rel(grads["torch"], grads["fp64"]), rel(grads["foak"], grads["fp64"])
        record(f"ce fp32 grad precision {kind}", e_foak <= 2 * e_torch + 1e-12, foak=e_foak, torch=e_torch)
    # 2. fp16 with a loss scale
    for n16, v16 in ((256, 4096), (64, 128256)) if not small else ((32, 1031),):
        x = (torch.randn(n16, v16, device=device) * 2).half()
        t = torch.randint(0, v16, (n16,), device=device)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        (cross_entropy(a, t) * 65536).backward()
        (F.cross_entropy(b.float(), t) * 65536).backward()
        z_foak, z_hf = (a.grad == 0).float().mean().item(), (b.grad == 0).float().mean().item()
        record(f"ce fp16 x65536 zero entries V={v16}", abs(z_foak - z_hf) < 1e-3 and rel(a.grad, b.grad) < 3e-3,
               zero_foak=z_foak, zero_hf=z_hf, grad_error=rel(a.grad, b.grad))
    nh, hh, vh = (40, 32, 1031) if small else (4096, 2048, 128256)
    h16 = (torch.randn(nh, hh, device=device) * 0.5).half()
    w16 = (torch.randn(vh, hh, device=device) * 0.02).half()
    t = torch.randint(0, vh, (nh,), device=device)
    ours = [h16.clone().requires_grad_(), w16.clone().requires_grad_()]
    (linear_cross_entropy(*ours, t) * 32768).backward()
    hf = [h16.clone().requires_grad_(), w16.clone().requires_grad_()]
    (F.cross_entropy(F.linear(*hf).float(), t) * 32768).backward()
    zeros = [((g.grad == 0).float().mean().item(), (r.grad == 0).float().mean().item()) for g, r in zip(ours, hf)]
    errors = [rel(g.grad, r.grad) for g, r in zip(ours, hf)]
    record("lce fp16 x32768 vs nn.Linear + fp32 loss", all(abs(a - b) < 1e-3 for a, b in zeros)
           and max(errors) < 1e-2, zero_fractions=zeros, grad_errors=errors)
    # 3. autocast over fp32 weights
    h = torch.randn(nh, hh, device=device)
    w = torch.randn(vh, hh, device=device) * 0.02
    t = torch.randint(0, vh, (nh,), device=device)
    t[::7] = -100

    def run(fn, autocast):
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = fn(*leaves)
        loss.backward()
        return loss.detach(), [x.grad for x in leaves]

    hf_fn = lambda a, b: F.cross_entropy(F.linear(a, b).float(), t)
    foak_fn = lambda a, b: linear_cross_entropy(a, b, t)
    (l_ours, (dh, dw)), (l_hf, (hf_dh, hf_dw)), (l_32, (_, fp32_dw)) = (run(foak_fn, True), run(hf_fn, True),
                                                                        run(hf_fn, False))
    record("lce bf16 autocast over fp32 weights vs nn.Linear under autocast",
           abs(l_ours - l_hf).item() < 1e-4 * abs(l_hf).item() and dw.dtype == torch.float32
           and rel(dh, hf_dh) < 1e-2 and rel(dw, fp32_dw) <= 1.3 * rel(hf_dw, fp32_dw),
           loss_foak=l_ours.item(), loss_hf=l_hf.item(), loss_fp32=l_32.item(), dh_vs_hf=rel(dh, hf_dh),
           dw_vs_fp32_foak=rel(dw, fp32_dw), dw_vs_fp32_hf=rel(hf_dw, fp32_dw))
    if not small:
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]

        def fwd_bwd(fn):
            def call():
                for x in leaves:
                    x.grad = None
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = fn(*leaves)
                loss.backward()
            return call

        ms = {name: timed_ms(fwd_bwd(fn)) for name, fn in (("hf_autocast", hf_fn), ("foak_autocast", foak_fn))}
        record("lce autocast fwd+bwd ms (h[4096,2048] fp32, W[128256,2048] fp32)", True, **ms)
    # 4. fp32 accumulation of a bf16 weight's gradient (cuBLAS bf16 x bf16 -> fp32 GEMMs)
    hb, wb = h.bfloat16(), w.bfloat16()
    ref_w = wb.double().requires_grad_()
    F.cross_entropy(F.linear(hb.double(), ref_w), t, reduction="sum").backward()
    errs = {}
    for accum in (None, torch.float32):
        leaf = wb.clone().requires_grad_()
        linear_cross_entropy(hb, leaf, t, reduction="sum", accum_dtype=accum, chunk_bytes=1 << 20 if small else None
                             ).backward()
        errs[str(accum)] = rel(leaf.grad, ref_w.grad)
    record("lce accum_dtype=fp32 for bf16 weights", errs["torch.float32"] <= errs["None"], **errs)
    # 5. per-class weights, 6. accuracy / entropy, 7. precompute_row_grad
    n5, v5 = (37, 1031) if small else (2048, 32000)
    logits = torch.randn(n5, v5, device=device) * 3
    t5 = torch.randint(0, v5, (n5,), device=device)
    t5[::5] = -100
    cw = torch.rand(v5, device=device) + 0.5
    for dtype in (torch.float32, torch.bfloat16):
        a = logits.to(dtype).clone().requires_grad_()
        b = logits.to(dtype).double().requires_grad_()
        cross_entropy(a, t5, weight=cw, label_smoothing=0.1).backward()
        F.cross_entropy(b, t5, weight=cw.double(), label_smoothing=0.1).backward()
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        record(f"ce weight= + label smoothing {dtype}", rel(a.grad, b.grad) < tol, grad_error=rel(a.grad, b.grad))
    _, acc, ent = cross_entropy(logits, t5, reduction="none", return_token_accuracy=True, return_entropy=True)
    valid = t5 != -100
    log_p = torch.log_softmax(logits.double(), -1)
    acc_ref = ((logits.argmax(-1) == t5) & valid).double()
    ent_ref = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    record("ce token accuracy / entropy", torch.equal(acc.double(), acc_ref) and rel(ent, ent_ref) < 1e-5,
           entropy_error=rel(ent, ent_ref))
    hb2 = h.bfloat16()
    up = torch.where(t != -100, -1.0 / (t != -100).sum(), 0.0).to(device)
    g = {}
    for pre in (False, True):
        leaves = [hb2.clone().requires_grad_(), wb.clone().requires_grad_()]
        linear_cross_entropy(*leaves, t, reduction="none", precompute_row_grad=pre).backward(up)
        g[pre] = [x.grad for x in leaves]
    record("lce precompute_row_grad (uniform incoming gradient) == plain none",
           all(rel(a, b) < 1e-2 for a, b in zip(g[True], g[False])), errors=[rel(a, b) for a, b in zip(g[True], g[False])])
    return rows


# ---- a whole patched model: torch.compile, outer saved-tensor hooks, the report after a move --------
def run_model_checks(device: str) -> list[dict]:
    """A small Llama (fp32 weights) patched with every switch: compiled with Inductor (fullgraph, graph
    breaks counted) vs eager, under save_on_cpu vs without, bf16 autocast vs unpatched; and the report's
    backend column of a model patched on the CPU and then moved to the GPU."""
    import transformers

    import foak

    rows = CheckLog()
    record = rows.check

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=4099,
                                      max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    switches = dict(fast_rms_layernorm=True, fast_rope_embeddings=True, fast_swiglu=True, fused_linear_loss=True)

    def build(patched, move_after_patch=False):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if not move_after_patch:
            model.to(device)
        report = foak.patch(model, **switches) if patched else None
        if move_after_patch:
            model.to(device)
        return model, report

    ids = torch.randint(0, config.vocab_size, (2, 301), generator=torch.Generator().manual_seed(3)).to(device)

    def step(model, fn=None, autocast=False, hooks=None):
        fn = model if fn is None else fn
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast), (hooks or _nullcontext()):
            loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach().float(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    def worst(a, b):
        return max(rel(a[n], b[n]) for n in b)

    ref_loss, ref = step(build(False)[0])
    model, report = build(True, move_after_patch=True)
    backends = {r.rule_id: r.backend for r in report.results if r.modules}
    record("report after patching on cpu and moving the model", all("triton on cuda" in b for b in backends.values())
           or device == "cpu", backends=backends)
    loss, grads = step(model)
    record("eager patched vs unpatched (fp32)", abs(loss - ref_loss).item() < 1e-4 and worst(grads, ref) < 1e-3,
           loss=loss.item(), ref_loss=ref_loss.item(), worst_grad=worst(grads, ref))
    if device == "cuda":
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model, _ = build(True)
        compiled = torch.compile(model, fullgraph=True)
        c_loss, c_grads = step(model, compiled)
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        record("torch.compile(fullgraph=True, inductor) of the patched model vs eager", breaks == 0 and
               abs(c_loss - loss).item() < 1e-3 and worst(c_grads, grads) < 1e-2, graph_breaks=breaks,
               loss=c_loss.item(), worst_grad=worst(c_grads, grads))
    model, report = build(True)
    h_loss, h_grads = step(model, hooks=torch.autograd.graph.save_on_cpu(pin_memory=device == "cuda"))
    note = report.result("llama.rms_norm_recompute").notes
    record("save_on_cpu: same gradients, recompute steps aside and says so", worst(h_grads, grads) < 1e-5
           and "stepped aside" in note, worst_grad=worst(h_grads, grads), note=note)
    a_ref_loss, a_ref = step(build(False)[0], autocast=True)
    a_loss, a_grads = step(build(True)[0], autocast=True)
    record("bf16 autocast over fp32 weights: patched vs unpatched", abs(a_loss - a_ref_loss).item() < 1e-2
           and worst(a_grads, a_ref) < 3e-2 and all(g.dtype == torch.float32 for g in a_grads.values()),
           loss=a_loss.item(), ref_loss=a_ref_loss.item(), worst_grad=worst(a_grads, a_ref))
    return rows


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- TRL SFTTrainer step ---------------------------------------------------------------------------
MODELS = {
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                    max_position_embeddings=8192),
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=301, max_position_embeddings=256),
}
WARMUP, TIMED = 3, 8


def trl_one(model_name: str, variant: str, device: str) -> dict:
    import datasets
    import transformers
    import trl

    from foak.data import char_tokenizer

    batch, seq = (4, 4096) if model_name != "tiny" else (2, 64)
    config = transformers.LlamaConfig(**MODELS[model_name])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    tokenizer = char_tokenizer()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch * (WARMUP + TIMED), seq), generator=gen)
    dataset = datasets.Dataset.from_dict({"input_ids": ids.tolist()})
    calls = []
    if variant == "foak":
        import foak
        import foak.ops.linear_cross_entropy as lce

        report = foak.patch(model, fast_rms_layernorm=True, fast_rope_embeddings=True, fast_swiglu=True,
                            fused_linear_loss=True, mixed_precision="bf16" if device == "cuda" else "no")
        real = lce._forward_op
        lce._forward_op = lambda *a: (calls.append(1), real(*a))[1]
    step_times = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()
            if state.global_step == WARMUP:
                reset_peak_memory(device)  # a no-op on CPU

        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.t0)

    args = trl.SFTConfig(
        output_dir="/tmp/trl_bench", max_steps=WARMUP + TIMED, per_device_train_batch_size=batch,
        learning_rate=1e-5, optim="adamw_torch_fused" if device == "cuda" else "adamw_torch", report_to="none",
        save_strategy="no", logging_steps=1, max_length=seq, bf16=device == "cuda", dataset_num_proc=None,
        use_liger_kernel=variant == "liger", seed=3, dataloader_num_workers=0)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=[Timer()])
    trainer.train()
    timed = step_times[WARMUP:]
    logs = [r for r in trainer.state.log_history if "loss" in r]
    out = {"model": model_name, "variant": variant, "batch": batch, "seq": seq,
           "tokens_per_s": batch * seq * len(timed) / sum(timed), "step_ms": 1e3 * sum(timed) / len(timed),
           "peak_gib": peak_memory(device)["peak_allocated_gib"] if device == "cuda" else float("nan"),
           "losses": [r["loss"] for r in logs], "mean_token_accuracy": [r.get("mean_token_accuracy") for r in logs],
           "entropy": [r.get("entropy") for r in logs], "num_tokens": [r.get("num_tokens") for r in logs],
           "foak_fused_loss_calls_per_step": len(calls) / (WARMUP + TIMED) if variant == "foak" else None}
    if variant == "foak":
        out["patch_report"] = str(report)
    return out


def versions(init_cuda: bool) -> dict:
    return {"environment": environment(init_cuda=init_cuda),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("checks", "model", "trl"))
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="llama1b")
    parser.add_argument("--variants", nargs="*", default=["trl", "liger", "foak"])
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "VARIANT"))
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.what in ("checks", "model"):
        rows = run_checks(args.device) if args.what == "checks" else run_model_checks(args.device)
        name = "real_world_checks_h200.json" if args.what == "checks" else "real_world_model_h200.json"
        result = {**versions(init_cuda=args.device == "cuda"), "rows": rows}
        (Path(args.out) / name).write_text(json.dumps(result, indent=1))
        print(f"{sum(r['ok'] for r in rows)} of {len(rows)} checks passed")
        return 0 if all(r["ok"] for r in rows) else 1
    if args.one:
        print("RESULT " + json.dumps(trl_one(*args.one, args.device)), flush=True)
        return 0
    rows = []
    for variant in args.variants:
        proc = subprocess.run([sys.executable, __file__, "trl", "--one", args.model, variant, "--device", args.device],
                              capture_output=True, text=True, env=os.environ)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            rows.append({"variant": variant, "error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])})
        else:
            rows.append(json.loads(line[len("RESULT "):]))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "patch_report"}), flush=True)
    # the variants ran in their own processes: this one needs no CUDA context for the GPU's name
    result = {**versions(init_cuda=False), "rows": rows}
    (Path(args.out) / f"trl_step_h200_{args.model}.json").write_text(json.dumps(result, indent=1))
    print("| variant | tokens/s | peak GiB | foak loss calls/step | losses | mean_token_accuracy | entropy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | error: {r['error'][:200]} | | | | | |")
            continue
        fmt = lambda xs: ", ".join(f"{x:.4f}" for x in xs[:3] if x is not None)
        print(f"| {r['variant']} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} | "
              f"{r['foak_fused_loss_calls_per_step']} | {fmt(r['losses'])} | {fmt(r['mean_token_accuracy'])} | "
              f"{fmt(r['entropy'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
