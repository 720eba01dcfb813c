"""Sliding-window attention on unpacked batches: whole training steps of a Mistral-7B-dims model (8 layers,
sliding_window 1024, B2 x S4096, bf16 weights, sdpa, fused AdamW, random weights and tokens): HF transformers
vs Liger (when importable: ``liger_kernel.transformers.apply_liger_kernel_to_mistral``) vs foak (every switch
foak has for Mistral; its sliding-window layers run foak's varlen attention with the window, no [S, S] mask)
vs ``foak-nowindow`` (the same without fast_packed_attention: transformers' dense sliding-window mask). Each
variant runs in its own process (clean peak memory), on an unpadded batch (no attention mask) and on a
right-padded one (rows of S and 3S/4 tokens, labels -100 at the pads).

    PYTHONPATH=src python benchmarks/window_attention.py --out DIR [--variants hf liger foak foak-nowindow]
                                                         [--kinds unpadded padded] [--window 1024] [--tag T]
    -> DIR/window_attention_h200[_T].json, and a table last
    PYTHONPATH=src python benchmarks/window_attention.py --cpu-smoke --out /tmp/x   # CPU: tiny shapes, fp32

Per variant and batch kind: tokens/s over the timed steps (3 warm-up, 8 timed; the first step's wall time
apart), peak allocated GiB over the timed steps, the losses. Checks (each in its own process, written to the
JSON's ``checks``):
- ``model_loss`` / ``model_grads``: foak's first-step loss and every gradient on the same weights and batch as
  HF's (one model, patched after the HF step), both against an fp32 copy of the model: foak's error within
  twice HF's own (floors 1e-3 loss, 5e-3 gradients); ``windowed_calls``: the report's row counts one windowed
  call per layer and no call of the previous implementation;
- ``op``: foak.ops.varlen_attention's flash path with the window (window_size_left = window - 1), forward and
  backward, on the benchmark's attention shape (Hq 32, Hkv 8, D 128), rows gathered from a padded batch,
  against explicit fp32 math per sequence (varlen_attention_reference): within 2e-2 relative.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from foak.bench.measure import CheckLog, StepTimer, environment, peak_memory, reset_peak_memory

MISTRAL_7B_8L = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, rope_theta=1e6)
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=301, max_position_embeddings=256)
VARIANTS = ("hf", "liger", "foak", "foak-nowindow")
KINDS = ("unpadded", "padded")
WARMUP, TIMED = 3, 8


def setup(smoke: bool, window: int):
    """(config, batch, seq, device, dtype)."""
    import transformers

    dims = TINY if smoke else MISTRAL_7B_8L
    config = transformers.MistralConfig(**dims, sliding_window=16 if smoke else window)
    config._attn_implementation = "sdpa"
    if smoke:
        return config, 2, 64, torch.device("cpu"), torch.float32
    return config, 2, 4096, torch.device("cuda"), torch.bfloat16


def build(config, device, dtype):
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    model.train()
    return model


def batches(kind: str, n: int, batch: int, seq: int, vocab: int, device) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        if kind == "unpadded":
            out.append({"input_ids": ids.to(device), "labels": ids.to(device)})
            continue
        mask = torch.ones_like(ids)
        for row in range(1, batch, 2):  # every other row holds 3/4 of the tokens (right padding)
            mask[row, 3 * seq // 4:] = 0
        ids = ids.masked_fill(mask == 0, 0)
        out.append({"input_ids": ids.to(device), "attention_mask": mask.to(device),
                    "labels": ids.masked_fill(mask == 0, -100).to(device)})
    return out


def apply_variant(model, variant: str):
    """(model, foak report or None)."""
    if variant == "hf":
        return model, None
    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_mistral

        apply_liger_kernel_to_mistral(model=model)
        return model, None
    import foak
    from foak.api import default_config

    switches = {k: True for k, v in default_config(model).model_dump(exclude={"mode", "base_layer"}).items()
                if v is True}
    if variant == "foak-nowindow":
        switches.pop("fast_packed_attention", None)
    return model, foak.patch(model, **switches)


def run_one(variant: str, kind: str, smoke: bool, window: int) -> dict:
    config, batch, seq, device, dtype = setup(smoke, window)
    model, report = apply_variant(build(config, device, dtype), variant)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    data = batches(kind, WARMUP + TIMED, batch, seq, config.vocab_size, device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def step(inputs):
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    sync()
    started = time.perf_counter()
    losses = [step(data[0])]
    sync()
    first_step_s = time.perf_counter() - started
    for inputs in data[1:WARMUP]:
        losses.append(step(inputs))
    sync()
    reset_peak_memory(device)
    timer = StepTimer(device)
    started = time.perf_counter()
    timer.mark()
    for inputs in data[WARMUP:]:
        losses.append(step(inputs))
        timer.mark()
    sync()
    seconds = time.perf_counter() - started
    memory = peak_memory(device)
    tokens = sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
                 for b in data[WARMUP:])
    return {"variant": variant, "kind": kind, "batch": batch, "seq": seq, "window": config.sliding_window,
            "tokens_per_s": TIMED * batch * seq / seconds, "real_tokens_per_s": tokens / seconds,
            "step_ms": seconds / TIMED * 1e3, "step_ms_all": timer.step_ms(), "first_step_s": first_step_s,
            "peak_gib": memory.get("peak_allocated_gib"), "peak_reserved_gib": memory.get("peak_reserved_gib"),
            "losses": [float(x) for x in losses], "patch_report": None if report is None else str(report)}


def relative_error(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_model(kind: str, smoke: bool, window: int) -> list[dict]:
    """foak vs HF on the same weights and batch: first-step loss and every gradient; the report's counts. In
    bf16 both are compared with an fp32 copy of the model (the bound: twice HF's own error, as foak verify
    does); in fp32 (the CPU smoke) foak is compared with HF directly (1e-5 loss, 1e-4 gradients)."""
    from foak.patching.packed_attention import packed_attention_counts, window_attention_counts

    config, batch, seq, device, dtype = setup(smoke, window)
    model = build(config, device, dtype)
    inputs = batches(kind, 1, batch, seq, config.vocab_size, device)[0]

    def loss_and_grads(m):
        m.zero_grad(set_to_none=True)
        loss = m(**inputs).loss
        loss.backward()
        grads = {n: p.grad.detach().float().cpu() for n, p in m.named_parameters() if p.grad is not None}
        m.zero_grad(set_to_none=True)
        return loss.detach().float().cpu(), grads

    exact = None
    if dtype != torch.float32:
        fp32 = build(config, device, torch.float32)  # the same seed: the same weights, in fp32
        fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        exact = loss_and_grads(fp32)
        del fp32
        if device.type == "cuda":
            torch.cuda.empty_cache()
    hf_loss, hf_grads = loss_and_grads(model)
    model, report = apply_variant(model, "foak")
    loss, grads = loss_and_grads(model)
    log = CheckLog()
    if exact is None:  # fp32: foak against HF
        loss_bound, grad_bound = 1e-5, 1e-4
        ref_loss, ref_grads = hf_loss, hf_grads
        err = relative_error(loss, ref_loss)
        worst = max(((relative_error(grads[n], g), n, grad_bound) for n, g in ref_grads.items()),
                    default=(math.inf, "none", grad_bound))
    else:  # bf16: foak's and HF's errors against fp32
        ref_loss, ref_grads = exact
        loss_bound = max(2 * relative_error(hf_loss, ref_loss), 1e-3)
        err = relative_error(loss, ref_loss)
        worst = max(((relative_error(grads[n], g), n, max(2 * relative_error(hf_grads[n], g), 5e-3))
                     for n, g in ref_grads.items()), key=lambda x: x[0] / x[2], default=(math.inf, "none", 1.0))
    log.check(f"model_loss/{kind}", err <= loss_bound, loss=float(loss), hf_loss=float(hf_loss),
              reference_loss=float(ref_loss), rel_error=err, bound=loss_bound)
    log.check(f"model_grads/{kind}", grads.keys() == ref_grads.keys() and worst[0] <= worst[2],
              worst_rel_error=worst[0], bound=worst[2], parameter=worst[1])
    windowed = window_attention_counts(report, "mistral.packed_attention")
    _, other = packed_attention_counts(report, "mistral.packed_attention")
    log.check(f"windowed_calls/{kind}", sum(windowed.values()) == config.num_hidden_layers and not other,
              windowed=windowed, previous=other)
    return list(log)


def check_op(smoke: bool, window: int) -> list[dict]:
    """varlen_attention with the window (flash on CUDA, per-sequence SDPA on the CPU) on a padded batch's
    gathered tokens vs explicit fp32 math per sequence, forward and backward."""
    from foak.ops import varlen_attention as va

    if smoke:
        B, S, Hq, Hkv, D, window, dtype, device, backend = 2, 64, 4, 2, 16, 16, torch.float32, "cpu", "sdpa"
    else:
        B, S, Hq, Hkv, D, dtype, device, backend = 2, 4096, 32, 8, 128, torch.bfloat16, "cuda", "flash"
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 3 * S // 4:] = False
    seqs, index = va.unpadded_sequences(mask.to(device))
    g = torch.Generator(device=device).manual_seed(0)
    T = int(mask.sum())
    q, k, v = (torch.randn(T, h, D, generator=g, device=device, dtype=dtype, requires_grad=True)
               for h in (Hq, Hkv, Hkv))
    dout = torch.randn(T, Hq, D, generator=g, device=device, dtype=dtype)
    out = va.varlen_attention(q, k, v, seqs, window=window, backend=backend)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = va.varlen_attention_reference(q32, k32, v32, seqs, window=window)
    rq, rk, rv = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    errs = {name: relative_error(a.float(), b) for name, a, b in
            (("out", out, ref), ("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv))}
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    log = CheckLog()
    log.check(f"op/{backend}", max(errs.values()) <= tol, window=window, tokens=T, tol=tol,
              index_tokens=int(index.numel()) if index is not None else T, **errs)
    return list(log)


def in_process(args: list[str]) -> dict | list:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=os.environ)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail), "args": args}
    return json.loads(line[len("RESULT "):])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny fp32 shapes: the code paths and checks")
    parser.add_argument("--tag", default="", help="suffix of the result file name")
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "KIND"))
    parser.add_argument("--check", choices=["model", "op"])
    parser.add_argument("--kind", default="unpadded", choices=list(KINDS))
    args = parser.parse_args()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: use --cpu-smoke")
    common = ["--window", str(args.window)] + (["--cpu-smoke"] if smoke else [])
    if args.one:
        print("RESULT " + json.dumps(run_one(*args.one, smoke, args.window)), flush=True)
        return 0
    if args.check == "model":
        print("RESULT " + json.dumps(check_model(args.kind, smoke, args.window)), flush=True)
        return 0
    if args.check == "op":
        print("RESULT " + json.dumps(check_op(smoke, args.window)), flush=True)
        return 0

    checks = []
    for found in [in_process(["--check", "op", *common]),
                  *(in_process(["--check", "model", "--kind", kind, *common]) for kind in args.kinds)]:
        checks.extend(found if isinstance(found, list) else [{"check": "error", "ok": False, **found}])
        print(json.dumps(checks[-1]), flush=True)
    rows = []
    variants = [v for v in args.variants if not (smoke and v == "liger")]  # Liger's kernels need a GPU
    if "liger" in variants:
        try:
            import liger_kernel.transformers  # noqa: F401
        except ImportError:
            variants.remove("liger")
            rows.append({"variant": "liger", "error": "liger-kernel is not installed"})
    for kind in args.kinds:
        for variant in variants:
            row = in_process(["--one", variant, kind, *common])
            row.setdefault("variant", variant)
            row.setdefault("kind", kind)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("patch_report", "step_ms_all")}), flush=True)
    result = {"environment": environment(init_cuda=False), "cpu_smoke": smoke, "warmup_steps": WARMUP,
              "timed_steps": TIMED, "checks": checks, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "window_attention_cpu_smoke" if smoke else "window_attention_h200"
    path = out / f"{name}{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    print("| kind | variant | tokens/s | vs hf | peak GiB | vs hf | step ms | first step s | first loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    hf = {r["kind"]: r for r in rows if r.get("variant") == "hf" and "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"| {r.get('kind', '')} | {r['variant']} | error: {r['error'][:150]} | | | | | | |")
            continue
        base = hf.get(r["kind"])
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        mem = f"{r['peak_gib'] / base['peak_gib']:.2f}x" if base and r["peak_gib"] and base["peak_gib"] else "-"
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        print(f"| {r['kind']} | {r['variant']} | {r['tokens_per_s']:.0f} | {speed} | {peak} | {mem} | "
              f"{r['step_ms']:.0f} | {r['first_step_s']:.1f} | {r['losses'][0]:.4f} |")
    failed = [c for c in checks if not c.get("ok")]
    print("checks: " + ("all ok" if not failed else "FAILED " + ", ".join(str(c.get("check")) for c in failed))
          + " (" + "; ".join(f"{c.get('check')}: " + ", ".join(f"{k} {v:.3g}" for k, v in c.items()
                                                               if isinstance(v, float)) for c in checks) + ")")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
