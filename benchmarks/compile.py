"""torch.compile (Inductor, fullgraph=True) of models patched with foak's default config (``foak.patch(model)``):
checks against eager, then whole training steps timed.

    python3 benchmarks/compile.py --out DIR                          # GPU: llama1b and mixtral-small dims
    python3 benchmarks/compile.py --out DIR --models llama1b --skip-checks     # timings of one model only
    TRITON_INTERPRET=1 python3 benchmarks/compile.py --device cpu --smoke --out /tmp/x   # CPU smoke
    -> DIR/compile_h200.json (compile_cpu_smoke.json with --smoke)

1. checks (fp32 weights, --check-layers layers, a small batch): for each model and batch kind ("padded": left
   padding and an attention mask; "packed": position ids restarting inside the rows, no mask), the patched
   model compiled with Inductor and fullgraph=True (a graph break raises; the break counter is recorded) vs
   the unpatched model and the patched model in eager mode: loss and the worst gradient (relative norms).
2. timings (bf16 weights on CUDA, fp32 on the CPU; AdamW, fused on CUDA; --layers layers of the model's dims;
   the model's batch size and sequence length unless --batch / --seq): per variant, a fresh model, then
   --warmup steps (the first one compiles; its time is reported as ``first_step_s``) and --steps timed steps
   (forward, backward, optimizer; median). Variants: ``hf`` (eager), ``hf-compiled`` (Inductor; graph breaks
   allowed and counted), ``foak`` (eager), ``foak-compiled`` (Inductor, fullgraph=True).

Before compiling, every model runs one eager forward: transformers installs its output-capturing hooks (MoE
router logits) at a model's first forward under a lock dynamo cannot trace.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import foak
from foak.bench.measure import environment, peak_memory, reset_peak_memory
from foak.bench.models import BUILTIN_MODELS
from foak.bench.step import packed_inputs, random_inputs
from foak.testing import relative_error

VARIANTS = ("hf", "hf-compiled", "foak", "foak-compiled")
GPU_MODELS = {"llama1b": 4, "mixtral-small": 2}  # model -> layers timed (of its dims)
SMOKE_MODELS = {"tiny": 2, "tiny-mixtral": 2}


def build(name: str, layers: int, dtype: torch.dtype, device: str, patched: bool):
    import transformers

    torch.manual_seed(0)
    config = BUILTIN_MODELS[name].config(num_hidden_layers=layers)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    model.train()
    report = foak.patch(model) if patched else None
    with torch.no_grad():  # transformers' output-capturing hooks, installed eagerly (see the docstring)
        model(input_ids=torch.zeros((1, 4), dtype=torch.long, device=device))
    return model, report


def batch_of(kind: str, batch: int, seq: int, vocab: int, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    if kind == "packed":
        return packed_inputs(batch, seq, vocab, gen, device)
    inputs = {**random_inputs(batch, seq, vocab, gen, device), "use_cache": False}
    if kind == "padded":
        mask = torch.ones_like(inputs["input_ids"])
        mask[0, : seq // 4] = 0  # left padding in the first row
        inputs["attention_mask"] = mask
        inputs["labels"] = inputs["labels"].masked_fill(mask == 0, -100)
    return inputs


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def loss_and_grads(run, model, batch):
    model.zero_grad(set_to_none=True)
    loss = run(**batch).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.detach().float() for n, p in model.named_parameters()
                                   if p.grad is not None}


def run_checks(models: dict, device: str, layers: int, batch: int, seq: int) -> list[dict]:
    loss_tol, grad_tol = (1e-5, 1e-4) if device == "cpu" else (1e-3, 2e-2)  # GPU: TF32 dots, Inductor's sums
    rows = []
    for name in models:
        ref, _ = build(name, layers, torch.float32, device, patched=False)
        model, report = build(name, layers, torch.float32, device, patched=True)
        switches = sorted({r.switch for r in report.results if r.modules})
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(model, fullgraph=True)
        for kind in ("padded", "packed"):
            inputs = batch_of(kind, batch, seq, model.config.vocab_size, device)
            row = {"check": f"{name} {kind}: foak compiled (inductor, fullgraph) vs eager", "switches": switches}
            try:
                start = time.perf_counter()
                loss_c, grads_c = loss_and_grads(compiled, model, inputs)
                sync(device)
                row["first_call_s"] = time.perf_counter() - start
            except Exception as error:  # noqa: BLE001 - a graph break under fullgraph: recorded, not raised
                row.update(ok=False, error=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")
                rows.append(row)
                print(f"FAIL {row['check']} {row['error']}", flush=True)
                continue
            loss_e, grads_e = loss_and_grads(model, model, inputs)
            loss_r, grads_r = loss_and_grads(ref, ref, inputs)
            row.update(
                graph_breaks=graph_breaks(), loss=loss_c.item(),
                loss_vs_unpatched=relative_error(loss_c, loss_r), loss_vs_eager_foak=relative_error(loss_c, loss_e),
                worst_grad_vs_unpatched=max(relative_error(grads_c[n], grads_r[n]) for n in grads_r),
                worst_grad_vs_eager_foak=max(relative_error(grads_c[n], grads_e[n]) for n in grads_e),
                same_parameters=grads_c.keys() == grads_r.keys())
            row["ok"] = (row["graph_breaks"] == 0 and row["same_parameters"]
                         and max(row["loss_vs_unpatched"], row["loss_vs_eager_foak"]) <= loss_tol
                         and max(row["worst_grad_vs_unpatched"], row["worst_grad_vs_eager_foak"]) <= grad_tol)
            rows.append(row)
            print(f"{'PASS' if row['ok'] else 'FAIL'} {json.dumps(row)}", flush=True)
        del ref, model, compiled
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def time_variant(name: str, variant: str, layers: int, batch: int, seq: int, kind: str, device: str,
                 warmup: int, steps: int) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    patched, compiled = variant.startswith("foak"), variant.endswith("-compiled")
    model, _ = build(name, layers, dtype, device, patched)
    inputs = batch_of(kind, batch, seq, model.config.vocab_size, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run = torch.compile(model, fullgraph=patched) if compiled else model
    row = {"model": name, "variant": variant, "layers": layers, "batch": batch, "seq": seq, "batch_kind": kind,
           "dtype": str(dtype).removeprefix("torch.")}

    def step():
        loss = run(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    try:
        reset_peak_memory(device)
        times = []
        for i in range(warmup + steps):
            sync(device)
            start = time.perf_counter()
            loss = step()
            sync(device)
            times.append(time.perf_counter() - start)
        row.update(first_step_s=times[0], step_ms=1e3 * statistics.median(times[warmup:]),
                   loss=loss.item(), graph_breaks=graph_breaks() if compiled else None, **peak_memory(device))
        row["tokens_per_s"] = batch * seq / (row["step_ms"] / 1e3)
    except Exception as error:  # noqa: BLE001 - recorded in the row
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    del model, optimizer, run
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny models, small batches, 1 warm-up + 2 steps")
    parser.add_argument("--models", nargs="*", help=f"default: {list(GPU_MODELS)} ({list(SMOKE_MODELS)} with --smoke)")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--layers", type=int, help="layers timed (default per model: " f"{GPU_MODELS})")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--batch-kind", default="plain", choices=("plain", "padded", "packed"))
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--check-layers", type=int, default=2)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--skip-timings", action="store_true")
    args = parser.parse_args()
    defaults = SMOKE_MODELS if args.smoke else GPU_MODELS
    models = {m: args.layers or defaults.get(m, 2) for m in (args.models or defaults)}
    unknown = [m for m in models if m not in BUILTIN_MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(BUILTIN_MODELS)}")
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    steps = args.steps if args.steps is not None else (2 if args.smoke else 10)
    result = {"environment": environment(init_cuda=args.device == "cuda"), "args": vars(args)}
    ok = True
    if not args.skip_checks:
        check_batch, check_seq = (2, 16) if args.smoke else (2, 512)
        result["checks"] = run_checks(models, args.device, args.check_layers, check_batch, check_seq)
        ok = all(r["ok"] for r in result["checks"])
    if not args.skip_timings:
        result["timings"] = []
        for name, layers in models.items():
            spec = BUILTIN_MODELS[name]
            batch = args.batch or (2 if args.smoke else spec.batch_size)
            seq = args.seq or (16 if args.smoke else min(spec.seq_length, 2048))
            for variant in args.variants:
                result["timings"].append(time_variant(name, variant, layers, batch, seq, args.batch_kind, args.device,
                                                      warmup, steps))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / ("compile_cpu_smoke.json" if args.smoke else f"compile_{'h200' if args.device == 'cuda' else args.device}.json")
    path.write_text(json.dumps(result, indent=1))
    if not args.skip_checks:
        print(f"{sum(r['ok'] for r in result['checks'])} of {len(result['checks'])} checks passed")
    if not args.skip_timings:
        print("| model | variant | step ms | tokens/s | first step s (compiles) | graph breaks | peak GiB |")
        print("|---|---|---|---|---|---|---|")
        for r in result["timings"]:
            if "error" in r:
                print(f"| {r['model']} | {r['variant']} | error: {r['error'][:120]} | | | | |")
                continue
            peak = r["peak_allocated_gib"] if r["peak_allocated_gib"] is not None else r["peak_rss_gib"]
            print(f"| {r['model']} | {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                  f"{r['first_step_s']:.1f} | {r['graph_breaks'] if r['graph_breaks'] is not None else '-'} | {peak:.2f} |")
    print(f"wrote {path}")
    return 0 if ok and all("error" not in r for r in result.get("timings", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
