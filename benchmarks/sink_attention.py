"""Attention sinks (gpt-oss) through foak's varlen attention: the op on CUDA bf16 and whole training steps of
the ``gptoss-8l`` bench model (foak.bench.models: gpt-oss-20b dims, 8 layers, 16 experts top-4, sliding window
128 alternating with full attention, B2 x S2048, bf16, random weights and tokens).

    PYTHONPATH=src python benchmarks/sink_attention.py --out DIR [--variants hf foak-eager foak]
                                                       [--kinds unpadded padded] [--tag T]
    -> DIR/sink_attention_h200[_T].json, and a table last
    PYTHONPATH=src python benchmarks/sink_attention.py --cpu-smoke --out /tmp/x   # CPU: tiny shapes, fp32

Variants (each step run in its own process: clean peak memory): ``hf`` (transformers: eager attention with
its sinks, [B, H, S, S] scores), ``foak-eager`` (every foak switch but fast_packed_attention: the attention
stays transformers' eager), ``foak`` (every switch: every layer through varlen_attention with the sinks, flash
on CUDA). Per variant and batch kind (unpadded; right-padded: every other row 3/4 of the tokens): tokens/s over
the timed steps (3 warm-up, 8 timed), peak allocated GiB, the losses.

Checks (each in its own process, in the JSON's ``checks``):
- ``op/<window>``: varlen_attention with sinks (flash on CUDA, bf16; B1 Hq64 Hkv8 D64 S4096, window 128 and
  full) forward and backward (dq, dk, dv, dsinks) against explicit fp32 math (softmax over [scores, sink],
  varlen_attention_reference): within 2e-2 relative; with the op's time (fwd+bwd ms) with and without sinks;
- ``model_loss`` / ``model_grads``: foak's first-step loss and every gradient (the sinks' included) on the same
  weights and batch as HF's, both against an fp32 copy (bound: twice HF's own error, floors 1e-3 / 5e-3; in
  the fp32 CPU smoke: foak against HF, 1e-5 / 1e-4), on B1 x S1024 (the fp32 copy must fit);
  ``sink_calls``: every layer ran foak's varlen attention with sinks and nothing ran transformers' eager.
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

VARIANTS = ("hf", "foak-eager", "foak")
KINDS = ("unpadded", "padded")
WARMUP, TIMED = 3, 8
RULE = "gpt_oss.packed_attention"


def setup(smoke: bool, check: bool = False):
    """(config, batch, seq, device, dtype)."""
    if smoke:
        from foak.models.tiny import tiny_config

        config = tiny_config("gpt_oss")
        config.router_aux_loss_coef = 0.0
        return config, 2, 48, torch.device("cpu"), torch.float32
    from foak.bench.models import BUILTIN_MODELS

    spec = BUILTIN_MODELS["gptoss-8l"]
    batch, seq = (1, 1024) if check else (spec.batch_size, spec.seq_length)
    return spec.config(), batch, seq, torch.device("cuda"), torch.bfloat16


def build(config, device, dtype):
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # transformers draws the sinks with std 0.02; trained gpt-oss sinks are O(1)
        g = torch.Generator(device="cpu").manual_seed(2)
        for layer in model.model.layers:
            s = layer.self_attn.sinks
            s.copy_(torch.randn(s.shape, generator=g).to(s.dtype))
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
        if batch == 1:
            mask[0, 3 * seq // 4:] = 0
        ids = ids.masked_fill(mask == 0, 0)
        out.append({"input_ids": ids.to(device), "attention_mask": mask.to(device),
                    "labels": ids.masked_fill(mask == 0, -100).to(device)})
    return out


def apply_variant(model, variant: str):
    """(model, foak report or None)."""
    if variant == "hf":
        return model, None
    import foak
    from foak.api import default_config

    switches = {k: True for k, v in default_config(model).model_dump(exclude={"mode", "base_layer"}).items()
                if v is True}
    if variant == "foak-eager":
        switches.pop("fast_packed_attention", None)
    return model, foak.patch(model, **switches)


def run_one(variant: str, kind: str, smoke: bool) -> dict:
    config, batch, seq, device, dtype = setup(smoke)
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
    return {"variant": variant, "kind": kind, "batch": batch, "seq": seq,
            "tokens_per_s": TIMED * batch * seq / seconds, "real_tokens_per_s": tokens / seconds,
            "step_ms": seconds / TIMED * 1e3, "step_ms_all": timer.step_ms(), "first_step_s": first_step_s,
            "peak_gib": memory.get("peak_allocated_gib"), "peak_reserved_gib": memory.get("peak_reserved_gib"),
            "peak_rss_gib": memory.get("peak_rss_gib"), "losses": [float(x) for x in losses],
            "patch_report": None if report is None else str(report)}


def relative_error(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_model(kind: str, smoke: bool) -> list[dict]:
    from foak.patching.packed_attention import packed_attention_counts, sink_attention_counts

    config, batch, seq, device, dtype = setup(smoke, check=True)
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
        fp32 = build(config, device, torch.float32)
        fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        exact = loss_and_grads(fp32)
        del fp32
        torch.cuda.empty_cache()
    hf_loss, hf_grads = loss_and_grads(model)
    model, report = apply_variant(model, "foak")
    loss, grads = loss_and_grads(model)
    log = CheckLog()
    if exact is None:
        loss_bound, grad_bound = 1e-5, 1e-4
        ref_loss, ref_grads = hf_loss, hf_grads
        err = relative_error(loss, ref_loss)
        worst = max(((relative_error(grads[n], g), n, grad_bound) for n, g in ref_grads.items()),
                    default=(math.inf, "none", grad_bound))
    else:
        ref_loss, ref_grads = exact
        loss_bound = max(2 * relative_error(hf_loss, ref_loss), 1e-3)
        err = relative_error(loss, ref_loss)
        worst = max(((relative_error(grads[n], g), n, max(2 * relative_error(hf_grads[n], g), 5e-3))
                     for n, g in ref_grads.items()), key=lambda x: x[0] / x[2], default=(math.inf, "none", 1.0))
    sinks = {n: relative_error(grads[n], g) for n, g in ref_grads.items() if n.endswith("sinks")}
    log.check(f"model_loss/{kind}", err <= loss_bound, loss=float(loss), hf_loss=float(hf_loss),
              reference_loss=float(ref_loss), rel_error=err, bound=loss_bound)
    log.check(f"model_grads/{kind}", grads.keys() == ref_grads.keys() and worst[0] <= worst[2],
              worst_rel_error=worst[0], bound=worst[2], parameter=worst[1],
              worst_sinks_rel_error=max(sinks.values(), default=math.inf))
    with_sinks, full = sink_attention_counts(report, RULE)
    _, other = packed_attention_counts(report, RULE)
    layers = config.num_hidden_layers
    log.check(f"sink_calls/{kind}", with_sinks == layers and not other, with_sinks=with_sinks, full=full,
              previous=other, layers=layers)
    return list(log)


def _time_ms(fn, device, reps=10, warmup=3) -> float:
    if device.type == "cuda":
        from foak.bench.measure import event_median_ms

        return event_median_ms(fn, reps=reps, warmup=warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def check_op(smoke: bool) -> list[dict]:
    """varlen_attention with sinks (flash on CUDA bf16, the CPU path in the smoke) vs explicit fp32 math."""
    from foak.ops import varlen_attention as va

    if smoke:
        S, Hq, Hkv, D, windows, dtype, device, backend = 64, 8, 2, 16, (8, None), torch.float32, "cpu", "sdpa"
    else:
        S, Hq, Hkv, D, windows, dtype, device, backend = 4096, 64, 8, 64, (128, None), torch.bfloat16, "cuda", "flash"
    device = torch.device(device)
    seqs = va.rows_as_sequences(1, S, device)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(S, h, D, generator=g, device=device, dtype=dtype, requires_grad=True)
               for h in (Hq, Hkv, Hkv))
    sinks = (torch.randn(Hq, generator=g, device=device, dtype=torch.float32) * 2).to(dtype).requires_grad_()
    dout = torch.randn(S, Hq, D, generator=g, device=device, dtype=dtype)
    log = CheckLog()
    for window in windows:
        out = va.varlen_attention(q, k, v, seqs, window=window, backend=backend, sinks=sinks)
        dq, dk, dv, ds = torch.autograd.grad(out, (q, k, v, sinks), dout)
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v, sinks)]
        ref = va.varlen_attention_reference(*leaves[:3], seqs, window=window, sinks=leaves[3])
        grads = torch.autograd.grad(ref, leaves, dout.float())
        errs = {name: relative_error(a.float(), b) for name, a, b in
                (("out", out, ref), ("dq", dq, grads[0]), ("dk", dk, grads[1]), ("dv", dv, grads[2]),
                 ("dsinks", ds, grads[3]))}
        del ref, grads, leaves
        if device.type == "cuda":
            torch.cuda.empty_cache()

        def fwd_bwd(with_sinks):
            o = va.varlen_attention(q, k, v, seqs, window=window, backend=backend,
                                    sinks=sinks if with_sinks else None)
            torch.autograd.grad(o, (q, k, v, sinks) if with_sinks else (q, k, v), dout)

        ms_sinks = _time_ms(lambda: fwd_bwd(True), device)
        ms_plain = _time_ms(lambda: fwd_bwd(False), device)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        log.check(f"op/{'full' if window is None else f'window{window}'}", max(errs.values()) <= tol,
                  backend=backend, seq=S, heads=Hq, kv_heads=Hkv, head_dim=D, tol=tol,
                  fwd_bwd_ms_sinks=ms_sinks, fwd_bwd_ms_no_sinks=ms_plain, **errs)
    return list(log)


def in_process(args: list[str]) -> dict | list:
    # foak's CUDA sinks path is gated until this check has run on a GPU (FOAK_CUDA_SINKS): this script runs it
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          env=dict(os.environ, FOAK_CUDA_SINKS="1"))
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
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny fp32 shapes: the code paths and checks")
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--tag", default="", help="suffix of the result file name")
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "KIND"))
    parser.add_argument("--check", choices=["model", "op"])
    parser.add_argument("--kind", default="unpadded", choices=list(KINDS))
    args = parser.parse_args()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: use --cpu-smoke")
    common = ["--cpu-smoke"] if smoke else []
    if args.one:
        print("RESULT " + json.dumps(run_one(*args.one, smoke)), flush=True)
        return 0
    if args.check == "model":
        print("RESULT " + json.dumps(check_model(args.kind, smoke)), flush=True)
        return 0
    if args.check == "op":
        print("RESULT " + json.dumps(check_op(smoke)), flush=True)
        return 0

    checks = []
    if not args.no_checks:
        for found in [in_process(["--check", "op", *common]),
                      *(in_process(["--check", "model", "--kind", kind, *common]) for kind in args.kinds)]:
            checks.extend(found if isinstance(found, list) else [{"check": "error", "ok": False, **found}])
            print(json.dumps(checks[-1]), flush=True)
    rows = []
    for kind in args.kinds:
        for variant in args.variants:
            row = in_process(["--one", variant, kind, *common])
            row.setdefault("variant", variant)
            row.setdefault("kind", kind)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("patch_report", "step_ms_all")}), flush=True)
    result = {"environment": environment(init_cuda=False), "cpu_smoke": smoke, "warmup_steps": WARMUP,
              "timed_steps": TIMED, "checks": checks, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "sink_attention_cpu_smoke" if smoke else "sink_attention_h200"
    path = out / f"{name}{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    ops = [c for c in checks if str(c.get("check", "")).startswith("op/")]
    if ops:
        print("| op | out err | dq err | dk err | dv err | dsinks err | fwd+bwd ms sinks | no sinks |")
        print("|---|---|---|---|---|---|---|---|")
        for c in ops:
            print(f"| {c['check']} | {c.get('out', math.nan):.2g} | {c.get('dq', math.nan):.2g} | "
                  f"{c.get('dk', math.nan):.2g} | {c.get('dv', math.nan):.2g} | {c.get('dsinks', math.nan):.2g} | "
                  f"{c.get('fwd_bwd_ms_sinks', math.nan):.2f} | {c.get('fwd_bwd_ms_no_sinks', math.nan):.2f} |")
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
    print("checks: " + ("all ok" if not failed else "FAILED " + ", ".join(str(c.get("check")) for c in failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
