"""foak's fused LoRA blocks on the GPU: correctness vs PEFT, then fwd+bwd time and saved memory of each block
vs the unfused PEFT modules, on a plain bf16 base and on a bitsandbytes NF4 (double-quantized) base.

    python3 benchmarks/lora.py --out DIR      # CUDA: checks, then the table (Llama-3-8B dims, 8192 tokens, r16)
    TRITON_INTERPRET=1 python3 benchmarks/lora.py --device cpu --out /tmp/x   # CPU smoke, tiny shapes

Writes DIR/lora_h200.json. Blocks (Llama-3-8B dims): qkv (foak.lora_linears vs three PEFT layers of one x),
o (foak.lora_linear vs one layer), mlp (gate+up by lora_linears, down by lora_glu_linear vs PEFT's
down(silu(gate(x)) * up(x))); fp32 adapters under bf16 autocast (what HF Trainer runs), dropout 0 and 0.1.
The ops are called as the fused_lora rule calls them (the NF4 weight is foak.patching.lora_bases' NF4Weight
of the bitsandbytes layer). "saved" = bytes the block keeps for its backward beyond its inputs and parameters.
With dropout, foak's masks are recovered (lora_dropout_mask) and applied to PEFT's math for the check.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from foak.bench.measure import environment, peak_extra_mib
from foak.bench.measure import event_median_ms as timed_ms  # CUDA-event median of fwd+bwd calls


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300)).item()


def peft_block(dims, r, p, base, device):
    """A module with one linear per entry of dims (bf16, or bitsandbytes NF4 Linear4bit), LoRA-wrapped."""
    import peft
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            for name, (n_in, n_out) in dims.items():
                setattr(self, name, nn.Linear(n_in, n_out, bias=False, dtype=torch.bfloat16))

    torch.manual_seed(0)
    block = Block()
    if base == "nf4":
        import bitsandbytes as bnb

        for name, (n_in, n_out) in dims.items():
            dense = getattr(block, name)
            q = bnb.nn.Linear4bit(n_in, n_out, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                                  compress_statistics=True)
            q.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, quant_type="nf4",
                                         compress_statistics=True)
            setattr(block, name, q)
    block = block.to(device)
    block.is_loaded_in_4bit = base == "nf4"  # what a from_pretrained(quantization_config=...) model says:
    # PEFT then wraps the 4-bit layers in its lora.bnb.Linear4bit (the class the fused_lora rule takes)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=p, target_modules=list(dims),
                             init_lora_weights=False)
    model = peft.get_peft_model(block, config)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.float() * 0.05  # fp32 adapters, as PEFT keeps them in mixed precision
    return model.base_model.model


def spec(layer, p, seed):
    from foak.patching.lora_bases import format_of

    return (format_of(layer).weight(layer.base_layer), layer.base_layer.bias, layer.lora_A["default"].weight,
            layer.lora_B["default"].weight, layer.scaling["default"], p, seed)


def peft_with_masks(layer, x, mask, p, fp32=False):
    """PEFT's lora layer math with a given dropout keep mask (None: no dropout); fp32: every GEMM in fp32 on
    the base weight dequantized to fp32 (the reference both bf16 computations are measured against)."""
    xa = x.float() if mask is None else x.float() * mask / (1 - p)
    if fp32:
        weight = spec(layer, p, None)[0]
        dense = weight.float() if isinstance(weight, torch.Tensor) else weight.dequantize(torch.float32)
        base = torch.nn.functional.linear(x.float(), dense)
    else:
        base = layer.base_layer(x)
    return base + layer.lora_B["default"](layer.lora_A["default"](xa)) * layer.scaling["default"]


def run_block(kind, block, names, x, p, seeds, masks, fp32=False):
    """(outputs, ...) of the block; seeds=None: PEFT's own modules; masks given: PEFT's math with them."""
    import foak
    from torch.nn.functional import silu

    layers = [getattr(block, n) for n in names]
    if masks is not None:
        call = lambda i, inp: peft_with_masks(layers[i], inp, masks[i], p, fp32)  # noqa: E731
    elif seeds is None:
        call = lambda i, inp: layers[i](inp)  # noqa: E731
    if kind == "mlp":
        if seeds is not None and masks is None:
            g, u = foak.lora_linears(x, [spec(layers[0], p, seeds[0]), spec(layers[1], p, seeds[1])])
            return [foak.lora_glu_linear(g, u, *spec(layers[2], p, seeds[2]))]
        return [call(2, silu(call(0, x)) * call(1, x))]
    if seeds is not None and masks is None:
        specs = [spec(layer, p, s) for layer, s in zip(layers, seeds)]
        return list(foak.lora_linears(x, specs)) if len(specs) > 1 else [foak.lora_linear(x, *specs[0][:6],
                                                                                        seed=specs[0][6])]
    return [call(i, x) for i in range(len(layers))]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--bases", nargs="*", default=["bf16", "nf4"])
    args = parser.parse_args()
    device = args.device
    small = device == "cpu"
    tokens, hidden, kv, inter, r = (37, 128, 64, 192, 7) if small else (8192, 4096, 1024, 14336, 16)
    blocks = {"qkv": {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv)},
              "o": {"o_proj": (hidden, hidden)},
              "mlp": {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}}
    rows, checks = [], []
    for base in args.bases:
        for kind, dims in blocks.items():
            for p in (0.0, 0.1):
                block = peft_block(dims, r, p, base, device)
                block.train()
                names = list(dims)
                x0 = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
                adapters = [t for n in names for t in (getattr(block, n).lora_A["default"].weight,
                                                       getattr(block, n).lora_B["default"].weight)]
                seeds = [torch.tensor([1234 + i], device=device) for i in range(len(names))]
                mask_shapes = ([x0.shape] * 2 + [(tokens, inter)]) if kind == "mlp" else [x0.shape] * len(names)

                def runner(which):
                    def run():
                        x = (x0.float() if which == "fp32" else x0.clone()).requires_grad_()
                        with torch.autocast(device, dtype=torch.bfloat16, enabled=which != "fp32"):
                            if which == "foak":
                                outs = run_block(kind, block, names, x, p, seeds, None)
                            elif which == "peft":
                                outs = run_block(kind, block, names, x, p, None, None)
                            else:  # PEFT's math with foak's masks (under autocast, or all in fp32)
                                import foak

                                masks = ([foak.ops.lora_dropout_mask(s, shp, p, device)
                                          for s, shp in zip(seeds, mask_shapes)] if p > 0 else [None] * len(names))
                                outs = run_block(kind, block, names, x, p, None, masks, fp32=which == "fp32")
                        return x, outs
                    return run

                def fwd_bwd(run):
                    def call():
                        for a in adapters:
                            a.grad = None
                        x, outs = run()
                        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                        return x
                    return call

                grads = {}
                for which in ("foak", "masked", "fp32"):
                    x_w = fwd_bwd(runner(which))()
                    grads[which] = [a.grad.clone() for a in adapters] + [x_w.grad]
                # foak's bf16 error vs the fp32 math, against PEFT's own bf16 error (same masks)
                ours = [rel(a, b) for a, b in zip(grads["foak"], grads["fp32"])]
                theirs = [rel(a, b) for a, b in zip(grads["masked"], grads["fp32"])]
                ok = all(o <= 2 * t + 2e-3 for o, t in zip(ours, theirs)) and max(ours) < 3e-2
                name = (f"{base} {kind} p={p} grads (A, B per projection, x) vs fp32 math"
                        + (" with the recovered masks" if p else "") + ": foak within 2x PEFT's bf16 error")
                checks.append({"check": name, "ok": ok, "foak_errors": ours, "peft_errors": theirs})
                print(f"{'PASS' if ok else 'FAIL'} {name} foak {[round(e, 5) for e in ours]} "
                      f"peft {[round(e, 5) for e in theirs]}", flush=True)
                row = {"base": base, "block": kind, "dropout": p, "tokens": tokens, "hidden": hidden, "r": r}
                inputs = {x0.untyped_storage().data_ptr()} | {t.untyped_storage().data_ptr()
                                                               for t in block.parameters()}
                for variant in ("peft", "foak"):
                    seen = {}

                    def pack(t):
                        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                        return t

                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        runner(variant)()
                    row[f"{variant}_saved_MiB"] = sum(v for k, v in seen.items() if k not in inputs) / 2**20
                    if not small:  # the peak over the timed calls, beyond what was allocated before them
                        peak, row[f"{variant}_ms"] = peak_extra_mib(lambda: timed_ms(fwd_bwd(runner(variant)), reps=20))
                        row[f"{variant}_peak_MiB"] = peak
                if not small:
                    row["speedup"] = row["peft_ms"] / row["foak_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                del block
                if not small:
                    torch.cuda.empty_cache()
    meta = {"environment": environment(init_cuda=device == "cuda"),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "lora_h200.json").write_text(json.dumps({**meta, "checks": checks, "rows": rows}, indent=1))
    print(json.dumps(meta))
    print("| base | block | dropout | PEFT ms (saved MiB, peak MiB) | foak ms (saved MiB, peak MiB) | speedup |")
    print("|---|---|---|---|---|---|")
    nan = float("nan")
    for row in rows:
        print(f"| {row['base']} | {row['block']} | {row['dropout']} | {row.get('peft_ms', nan):.3f} "
              f"({row['peft_saved_MiB']:.0f}, {row.get('peft_peak_MiB', nan):.0f}) | {row.get('foak_ms', nan):.3f} "
              f"({row['foak_saved_MiB']:.0f}, {row.get('foak_peak_MiB', nan):.0f}) | {row.get('speedup', nan):.2f} |")
    print(f"{sum(c['ok'] for c in checks)} of {len(checks)} checks passed")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
