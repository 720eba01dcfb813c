"""fp32 LoRA adapters on a bf16 base outside autocast (PEFT's default adapter dtype in a custom loop): foak's
lowrank kernels (the adapter's fp32 products read the bf16 operands in place) vs the torch path they replace
(fp32 copies of the activations and their gradients), vs bf16 adapters (what autocast runs) and vs PEFT.

    python3 benchmarks/lowrank.py --out DIR          # CUDA: checks, then the table (Llama-3.1-8B dims, r16)
    TRITON_INTERPRET=1 python3 benchmarks/lowrank.py --device cpu --tokens 70 --out /tmp/x   # CPU smoke

Checks (relative error vs fp64 math): each kernel on its own; one projection's forward and backward (output, dx,
dA, dB) for foak, foak's torch path and PEFT, on a bf16 and on an fp16 base; LoRA dropout's masks. Times: CUDA-event
medians of each product, and of a projection's forward + backward (o: 4096->4096, k: 4096->1024, gate: 4096->14336, down: 14336->4096). Writes DIR/lowrank.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from pathlib import Path

import torch

from foak.bench.measure import environment, install_interpreter_compat
from foak.bench.measure import event_median_ms as timed_ms
from foak.ops import lowrank as lowrank_mod
from foak.ops.lora import lora_linear
from foak.ops.lowrank import lowrank_add_, lowrank_down, lowrank_tokens

SHAPES = {"o": (4096, 4096), "k": (4096, 1024), "gate": (4096, 14336), "down": (14336, 4096)}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300)).item()


@contextlib.contextmanager
def fma_dots():
    """The lowrank kernels with IEEE fp32 FMA dots instead of the bf16-split tensor-core products."""
    lowrank_mod.TUNING["split"] = False
    try:
        yield
    finally:
        lowrank_mod.TUNING["split"] = True


@contextlib.contextmanager
def torch_path():
    """foak's LoRA ops with the fp32-copy torch path for mixed dtypes (what ran before ops.lowrank)."""
    saved = dict(lowrank_mod.USE)
    lowrank_mod.USE.update(cuda=False, cpu=False)
    try:
        yield
    finally:
        lowrank_mod.USE.update(saved)


def peft_layer(n_in, n_out, r, device, adapter_dtype, base_dtype=torch.bfloat16):
    import peft
    from torch import nn

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(n_in, n_out, bias=False, dtype=base_dtype)).to(device)
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"],
                                                      init_lora_weights=False), autocast_adapter_dtype=False)
    layer = model.base_model.model[0]
    for module in (layer.lora_A["default"], layer.lora_B["default"]):
        module.to(adapter_dtype)
    return layer


def args_of(layer):
    return (layer.base_layer.weight, None, *adapters(layer), layer.scaling["default"])


def adapters(layer):
    return [layer.lora_A["default"].weight, layer.lora_B["default"].weight]


def exact_fwd_bwd(layer, x, dy):
    """The layer's forward and backward (out, dx, dA, dB) in fp64 math."""
    a, b = adapters(layer)
    return fwd_bwd(lambda t: torch.nn.functional.linear(t, layer.base_layer.weight.double())
                   + layer.scaling["default"] * (t @ a.double().t()) @ b.double().t(), x.double(), dy.double(),
                   [a, b])()


def fwd_bwd(fn, x, dy, leaves):
    def call():
        xl = x.detach().requires_grad_()
        out = fn(xl)
        return [out, *torch.autograd.grad(out, [xl, *leaves], dy)]
    return call


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    args = parser.parse_args()
    device, m, r = torch.device(args.device), args.tokens, args.rank
    cuda = device.type == "cuda"
    lowrank_mod.USE[device.type] = True  # the LoRA ops take the kernels (whatever the default)
    if not cuda:
        install_interpreter_compat()  # bf16 rounding in the interpreter (the tests' layer)
    scale = 1 / 64 if not cuda else 1  # CPU smoke: small shapes
    time = timed_ms if cuda else (lambda fn, **_: (fn(), float("nan"))[1])
    rows, failures = [], []
    for name in args.shapes:
        n_in, n_out = (max(17, int(d * scale)) for d in SHAPES[name])
        torch.manual_seed(1)
        x = torch.randn(m, n_in, device=device).to(torch.bfloat16)
        dy = torch.randn(m, n_out, device=device).to(torch.bfloat16) * 0.01
        a = torch.randn(r, n_in, device=device) / n_in ** 0.5
        b = torch.randn(n_out, r, device=device)
        h = lowrank_down(x, a)
        g = lowrank_down(dy, b.t(), 2.0)
        out = torch.randn(m, n_out, device=device).to(torch.bfloat16)
        checks = {
            "down": rel(h, x.double() @ a.double().t()),
            "down_bt": rel(g, 2.0 * dy.double() @ b.double()),
            "add": rel(lowrank_add_(out.clone(), h, b, 0.5), out.double() + 0.5 * h.double() @ b.double().t()),
            # the same sum as torch forms it (fp32, rounded to bf16 once): the bar for "add"
            "add_torch": rel(out.float().add_(h @ b.t(), alpha=0.5).to(torch.bfloat16),
                             out.double() + 0.5 * h.double() @ b.double().t()),
            "tokens_dB": rel(lowrank_tokens(dy, h, 2.0), 2.0 * dy.double().t() @ h.double()),
            "tokens_dA": rel(lowrank_tokens(x, g), x.double().t() @ g.double()),
        }
        # the projection: foak (lowrank), foak's torch path, PEFT; each vs the fp64 copy of the layer
        layer = peft_layer(n_in, n_out, r, device, torch.float32)
        leaves = adapters(layer)
        exact = exact_fwd_bwd(layer, x, dy)
        variants = {"foak": fwd_bwd(lambda t: lora_linear(t, *args_of(layer)), x, dy, leaves),
                    "peft": fwd_bwd(layer, x, dy, leaves)}
        results = {"foak": variants["foak"]()}
        with fma_dots():
            results["foak-fma"] = variants["foak"]()
            fma = {"down": rel(lowrank_down(x, a), x.double() @ a.double().t()),
                   "add": rel(lowrank_add_(out.clone(), h, b, 0.5), out.double() + 0.5 * h.double() @ b.double().t()),
                   "tokens_dA": rel(lowrank_tokens(x, g), x.double().t() @ g.double())}
        checks.update({f"fma_{k}": v for k, v in fma.items()})
        with torch_path():
            results["foak-torch-path"] = variants["foak"]()
        results["peft"] = variants["peft"]()
        for variant, got in results.items():
            names = ("out", "dx", "dA", "dB")
            checks.update({f"{variant}_{n}": rel(v, e) for n, v, e in zip(names, got, exact)})
        for variant in ("foak", "foak-fma", "foak-torch-path"):
            for n in ("out", "dx", "dA", "dB"):
                if checks[f"{variant}_{n}"] > 2 * checks[f"peft_{n}"] + 1e-6:
                    failures.append(f"{name} {variant} {n}: {checks[f'{variant}_{n}']:.2e} vs PEFT "
                                    f"{checks[f'peft_{n}']:.2e}")
        # LoRA dropout (p 0.1): the kernels' per-tile masks vs foak's torch path (lora_dropout_mask), same seed:
        # a mask that differs in any tile shows as an O(1) difference, the arithmetic as rounding
        def with_dropout(context):
            torch.manual_seed(5)
            with context:
                return fwd_bwd(lambda t_: lora_linear(t_, *args_of(layer), dropout_p=0.1), x, dy, leaves)()
        got, ref = with_dropout(contextlib.nullcontext()), with_dropout(torch_path())
        for n, v, e, tol in zip(("out", "dx", "dA", "dB"), got, ref, (1e-2, 1e-2, 1e-4, 1e-4)):
            checks[f"dropout_{n}_vs_torch_path"] = err = rel(v, e)
            if err > tol:
                failures.append(f"{name} dropout {n}: {err:.2e} from foak's torch path (> {tol})")
        got = ref = None
        # an fp16 base (the kernels' FMA dots: fp16 operands are not split): foak vs PEFT, each vs fp64
        layer_h = peft_layer(n_in, n_out, r, device, torch.float32, torch.float16)
        exact_h = exact_fwd_bwd(layer_h, x, dy)
        foak_h = fwd_bwd(lambda t_: lora_linear(t_, *args_of(layer_h)), x.half(), dy.half(), adapters(layer_h))()
        peft_h = fwd_bwd(layer_h, x.half(), dy.half(), adapters(layer_h))()
        for n, f, p, e in zip(("out", "dx", "dA", "dB"), foak_h, peft_h, exact_h):
            checks[f"fp16_foak_{n}"], checks[f"fp16_peft_{n}"] = foak_err, peft_err = rel(f, e), rel(p, e)
            if foak_err > 2 * peft_err + 1e-6:
                failures.append(f"{name} fp16 base {n}: {foak_err:.2e} vs PEFT {peft_err:.2e}")
        layer_h = exact_h = foak_h = peft_h = None
        for k in ("add", "fma_add"):
            if checks[k] > 1.05 * checks["add_torch"]:
                failures.append(f"{name} {k}: {checks[k]:.2e} vs torch's {checks['add_torch']:.2e}")
        for k in ("down", "down_bt", "tokens_dB", "tokens_dA", "fma_down", "fma_tokens_dA"):
            if checks[k] > 1e-5:
                failures.append(f"{name} {k}: {checks[k]:.2e}")
        # times
        t = {
            "down lowrank": time(lambda: lowrank_down(x, a)),
            "down torch": time(lambda: torch.mm(x.float(), a.t())),
            "add lowrank": time(lambda: lowrank_add_(out, h, b, 0.5)),
            "add torch": time(lambda: torch.addmm(out.float(), h, b.t(), alpha=0.5).to(torch.bfloat16)),
            "dy-grads lowrank": time(lambda: (lowrank_tokens(dy, h), lowrank_down(dy, b.t()))),
            "dy-grads torch": time(lambda: (lambda d: (torch.mm(d.t(), h), torch.mm(d, b)))(dy.float())),
            "dA lowrank": time(lambda: lowrank_tokens(x, g)),
            "dA torch": time(lambda: torch.mm(g.t(), x.float())),
            "proj foak": time(variants["foak"]),
            "proj peft": time(variants["peft"]),
        }
        with fma_dots():
            t.update({"down fma": time(lambda: lowrank_down(x, a)),
                      "add fma": time(lambda: lowrank_add_(out, h, b, 0.5)),
                      "dy-grads fma": time(lambda: (lowrank_tokens(dy, h), lowrank_down(dy, b.t()))),
                      "dA fma": time(lambda: lowrank_tokens(x, g)),
                      "proj foak-fma": time(variants["foak"])})
        dropped = fwd_bwd(lambda t_: lora_linear(t_, *args_of(layer), dropout_p=0.1), x, dy, leaves)
        t["proj foak p0.1"] = time(dropped)
        with torch_path():
            t["proj foak-torch-path"] = time(variants["foak"])
            t["proj foak-torch-path p0.1"] = time(dropped)
        layer16 = peft_layer(n_in, n_out, r, device, torch.bfloat16)
        t["proj foak bf16 adapters"] = time(fwd_bwd(lambda t_: lora_linear(t_, *args_of(layer16)), x, dy,
                                                    adapters(layer16)))
        rows.append({"shape": name, "in": n_in, "out": n_out, "tokens": m, "rank": r, "checks": checks, "ms": t})
        layer = layer16 = variants = results = exact = None  # free before the next shape
        if cuda:
            torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "environment": environment(init_cuda=cuda), "rows": rows, "failures": failures}
    (Path(args.out) / "lowrank.json").write_text(json.dumps(record, indent=1))
    print("shape | proj fwd+bwd ms: foak  foak-fma  torch-path  bf16-adapters  peft | down  add  dy-grads  dA "
          "(lowrank/fma/torch)")
    for row in rows:
        t = row["ms"]
        print(f"{row['shape']:5s} | dropout 0.1: foak {t['proj foak p0.1']:.2f}  torch-path "
              f"{t['proj foak-torch-path p0.1']:.2f}")
        print(f"{row['shape']:5s} | {t['proj foak']:.2f}  {t['proj foak-fma']:.2f}  {t['proj foak-torch-path']:.2f}  "
              f"{t['proj foak bf16 adapters']:.2f}  {t['proj peft']:.2f} | "
              + "  ".join(f"{t[k + ' lowrank']:.3f}/{t[k + ' fma']:.3f}/{t[k + ' torch']:.3f}"
                          for k in ("down", "add", "dy-grads", "dA")))
    print("checks:", "all pass" if not failures else f"{len(failures)} FAIL: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
