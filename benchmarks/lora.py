"""foak's LoRA op on the GPU: correctness vs PEFT's lora.Linear, then fwd+bwd time and saved memory of one
block vs the unfused PEFT modules (issue [lora], slice 1: plain base, no patch rules yet).

    python3 benchmarks/lora.py --out DIR      # CUDA: checks, then the table (Llama-3-8B dims, 8192 tokens, r16)
    TRITON_INTERPRET=1 python3 benchmarks/lora.py --device cpu --out /tmp/x   # CPU smoke, tiny shapes

Writes DIR/lora_h200.json. Blocks: q/k/v from one x (foak.lora_linears vs three PEFT lora.Linear) and o
(foak.lora_linear vs one lora.Linear); bf16 base, fp32 adapters under bf16 autocast (what HF Trainer runs),
dropout 0 and 0.1. "saved" = bytes the block keeps for its backward beyond its inputs and parameters.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_world import timed_ms  # noqa: E402  (CUDA-event median of fwd+bwd calls)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300)).item()


def peft_layers(dims, r, p, dtype, device):
    import peft
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            for name, (n_in, n_out) in dims.items():
                setattr(self, name, nn.Linear(n_in, n_out, bias=False))

    torch.manual_seed(0)
    block = Block().to(device=device, dtype=dtype)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=p, target_modules=list(dims),
                             init_lora_weights=False)
    model = peft.get_peft_model(block, config)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.float() * 0.05  # fp32 adapters, as PEFT keeps them in mixed precision
    return model.base_model.model


def projections(block, names, p):
    out = []
    for name in names:
        layer = getattr(block, name)
        out.append((layer.base_layer.weight, layer.base_layer.bias, layer.lora_A["default"].weight,
                     layer.lora_B["default"].weight, layer.scaling["default"], p, None))
    return out


def saved_bytes(fn):
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen


def main() -> int:
    import foak

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = args.device
    small = device == "cpu"
    tokens, hidden, kv, r = (37, 96, 32, 7) if small else (8192, 4096, 1024, 16)
    blocks = {"qkv": {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv)},
              "o": {"o_proj": (hidden, hidden)}}
    params = {n: p for n, p in (("bf16", torch.bfloat16),)}
    rows, checks = [], []
    for block_name, dims in blocks.items():
        for p in (0.0, 0.1):
            block = peft_layers(dims, r, p, params["bf16"], device)
            names = list(dims)
            x0 = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
            projs = projections(block, names, p)
            adapters = [t for pr in projs for t in pr[2:4]]

            def run_peft():
                x = x0.clone().requires_grad_()
                with torch.autocast(device, dtype=torch.bfloat16):
                    outs = [getattr(block, n)(x) for n in names]
                return x, outs

            def run_foak(seeds=None):
                x = x0.clone().requires_grad_()
                prs = [(*pr[:6], None if seeds is None else seeds[i]) for i, pr in enumerate(projs)]
                with torch.autocast(device, dtype=torch.bfloat16):
                    outs = (list(foak.lora_linears(x, prs)) if len(prs) > 1
                            else [foak.lora_linear(x, *prs[0])])
                return x, outs

            def fwd_bwd(run):
                def call():
                    for a in adapters:
                        a.grad = None
                    x, outs = run()
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                    return x
                return call

            if p == 0:  # exact comparison (with dropout the masks differ by design: PEFT uses torch's RNG)
                block.train()
                x_f = fwd_bwd(run_foak)()
                g_f = [a.grad.clone() for a in adapters] + [x_f.grad]
                x_p = fwd_bwd(run_peft)()
                g_p = [a.grad.clone() for a in adapters] + [x_p.grad]
                errors = [rel(a, b) for a, b in zip(g_f, g_p)]
                ok = max(errors) < 2e-2
                checks.append({"check": f"{block_name} p=0 grads vs PEFT (bf16 autocast)", "ok": ok,
                               "errors": errors})
                print(f"{'PASS' if ok else 'FAIL'} {block_name} p=0 grads vs PEFT {errors}", flush=True)
            else:  # the mask the op used, recovered, applied to PEFT's math: same gradients
                block.train()
                seeds = [torch.tensor([1234 + i], device=device) for i in range(len(projs))]
                masks = [foak.ops.lora_dropout_mask(s, x0.shape, p, device) for s in seeds]
                x_f = fwd_bwd(lambda: run_foak(seeds))()
                g_f = [a.grad.clone() for a in adapters] + [x_f.grad]
                for a in adapters:
                    a.grad = None
                x = x0.clone().requires_grad_()
                with torch.autocast(device, dtype=torch.bfloat16):
                    outs = []
                    for i, n in enumerate(names):
                        layer = getattr(block, n)
                        xa = x.float() * masks[i] / (1 - p)
                        lora = layer.lora_B["default"](layer.lora_A["default"](xa)) * layer.scaling["default"]
                        outs.append(layer.base_layer(x) + lora)
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                g_p = [a.grad.clone() for a in adapters] + [x.grad]
                errors = [rel(a, b) for a, b in zip(g_f, g_p)]
                keep = [m.float().mean().item() for m in masks]
                ok = max(errors) < 2e-2 and all(abs(k - (1 - p)) < 0.01 for k in keep)
                checks.append({"check": f"{block_name} p={p} grads vs PEFT math with the recovered mask", "ok": ok,
                               "errors": errors, "keep_fraction": keep})
                print(f"{'PASS' if ok else 'FAIL'} {block_name} p={p} grads vs recovered-mask PEFT {errors} {keep}",
                      flush=True)
            row = {"block": block_name, "dropout": p, "tokens": tokens, "hidden": hidden, "r": r}
            for name, run in (("peft", run_peft), ("foak", run_foak)):
                _, seen = saved_bytes(lambda: run())
                inputs = {x0.untyped_storage().data_ptr()} | {t.untyped_storage().data_ptr()
                                                               for t in block.parameters()}
                row[f"{name}_saved_MiB"] = sum(v for k, v in seen.items() if k not in inputs) / 2**20
                if not small:
                    row[f"{name}_ms"] = timed_ms(fwd_bwd(run), reps=20)
            if not small:
                row["speedup"] = row["peft_ms"] / row["foak_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    from importlib.metadata import version

    import triton

    meta = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "triton": triton.__version__,
            "peft": version("peft"), "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "lora_h200.json").write_text(json.dumps({**meta, "checks": checks, "rows": rows}, indent=1))
    print("| block | dropout | PEFT ms (saved MiB) | foak ms (saved MiB) | speedup |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['block']} | {row['dropout']} | {row.get('peft_ms', float('nan')):.3f} "
              f"({row['peft_saved_MiB']:.1f}) | {row.get('foak_ms', float('nan')):.3f} ({row['foak_saved_MiB']:.1f}) "
              f"| {row.get('speedup', float('nan')):.2f} |")
    print(f"{sum(c['ok'] for c in checks)} of {len(checks)} checks passed")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
