"""``foak verify``: run one fixed batch through an unpatched and a patched copy of a model, forward and
backward, rule by rule and with every rule together, and compare losses and all parameter gradients."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from foak.config import SWITCH_TO_RULE
from foak.testing import relative_error

# foak rule switch -> the acceleration-config key that enables it (the rules that exist today). Not
# packed_attention: the fixed batch is not packed, so that rule would only delegate (a row that checks
# nothing); tests/test_packing.py compares packed batches with each sequence alone
SWITCH_KEYS = {rule: key for key, rule in SWITCH_TO_RULE.items() if rule not in ("lora", "moe", "packed_attention")}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


@dataclass
class VerifyRow:
    name: str
    modules: int
    loss_error: float
    grad_error: float
    worst_param: str
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.loss_error <= self.tolerance and self.grad_error <= self.tolerance


def fixed_batch(vocab_size: int, batch: int = 2, seq: int = 13, seed: int = 0, device="cpu"):
    """Random token ids with left padding on the second row (labels -100 there)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, : seq // 4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _errors(ref, got) -> tuple[float, dict[str, float]]:
    """Relative error of the loss and of every parameter gradient of ``got`` against ``ref``."""
    (ref_loss, ref_grads), (loss, grads) = ref, got
    if ref_grads.keys() != grads.keys():
        missing = sorted(ref_grads.keys() ^ grads.keys())
        raise ValueError(f"gradient missing on one side: {missing[:3]}")
    return relative_error(loss, ref_loss), {n: relative_error(grads[n], g) for n, g in ref_grads.items()}


def _global_error(ref, got) -> float:
    """Relative error of all parameter gradients taken as one vector."""
    names = sorted(ref[1])
    flat = lambda grads: torch.cat([grads[n].double().flatten() for n in names])  # noqa: E731
    return relative_error(flat(got[1]), flat(ref[1]))


def _row(name, modules, loss_error, grad_errors, tolerance) -> VerifyRow:
    worst_name = max(grad_errors, key=lambda n: grad_errors[n] if grad_errors[n] == grad_errors[n] else float("inf"))
    return VerifyRow(name, modules, loss_error, grad_errors[worst_name], worst_name, tolerance)


def verify_model(model, switches: list[str] | None = None, batch=None) -> list[VerifyRow]:
    """One row per enabled rule (patched alone) plus one with all of them; the model itself is not patched.

    fp32 models: the patched model's loss and gradients against the unpatched model's (<= 1e-5 relative).
    bf16/fp16 models: both are compared with an fp32 copy of the unpatched model, and a row reports how
    much error foak adds on top of HF's own low-precision error, over all gradients taken together (it
    must stay within the tolerance), since two low-precision runs differ from each other by rounding alone.
    """
    from foak.models import rules_for
    from foak.patching import patch

    available = sorted({r.switch for r in rules_for(model)} & SWITCH_KEYS.keys())
    if switches is None:  # everything foak has for this architecture, with the fused head as the loss
        switches = [s for s in available if s != "loss"]
    unknown = sorted(set(switches) - set(available))
    if unknown:
        raise ValueError(f"foak verify: {unknown} not available for this model (available: {available})")
    if not switches:  # nothing compared is never a pass
        raise ValueError(f"foak verify: no rule to check (available for this model: {available or 'none'})")
    model.eval()  # dropout off: both sides must see the same function (gradients are still computed)
    dtype = next(model.parameters()).dtype
    tolerance = TOLERANCE[dtype]
    if batch is None:
        batch = fixed_batch(model.config.vocab_size, device=next(model.parameters()).device)
    unpatched = _loss_and_grads(copy.deepcopy(model), batch)
    if dtype == torch.float32:
        reference, baseline = unpatched, None
    else:
        reference = _loss_and_grads(copy.deepcopy(model).float(), batch)
        baseline = _global_error(reference, unpatched)
    rows = []
    combos = [[s] for s in switches] + ([switches] if len(switches) > 1 else [])
    for combo in combos:
        patched = copy.deepcopy(model)
        report = patch(patched, **{SWITCH_KEYS[s]: True for s in combo})
        modules = sum(r.modules for r in report.results)
        name = combo[0] if len(combo) == 1 else "all: " + ", ".join(combo)
        got = _loss_and_grads(patched, batch)
        loss_error = _errors(unpatched, got)[0]
        if baseline is None:
            rows.append(_row(name, modules, loss_error, _errors(reference, got)[1], tolerance))
        else:  # the error foak adds beyond HF's own in this precision, over all gradients together
            # (per parameter, a bf16 rounding difference can flip an MoE router's top-k and move that
            # router's small gradient a lot, in either implementation)
            excess = max(0.0, _global_error(reference, got) - baseline)
            rows.append(VerifyRow(name, modules, loss_error, excess, "(all gradients)", tolerance))
    return rows


def gptq_quantization(path_or_config) -> dict | None:
    """The ``quantization_config`` of a model whose config.json (a model directory, or the parsed config.json)
    says ``quant_method: gptq`` (load it with :func:`foak.quant.load_gptq`), else None."""
    import json
    import os

    if isinstance(path_or_config, dict):
        config = path_or_config
    else:
        config_path = os.path.join(os.fspath(path_or_config), "config.json")
        if not os.path.isfile(config_path):
            return None
        with open(config_path) as f:
            config = json.load(f)
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "gptq":
        return qc
    return None


def compared_note(model) -> str | None:
    """What verify_model compares on a model with GPTQ layers (None for other models): their 4-bit weights
    are frozen buffers, so only the loss and the gradients of the model's other parameters are compared."""
    import re

    from foak.quant.gptq import GPTQLinear

    n_gptq = sum(isinstance(m, GPTQLinear) for m in model.modules())
    if not n_gptq:
        return None
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    kinds = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in trainable))
    return (f"GPTQ model: its {n_gptq} GPTQLinear layers hold frozen 4-bit weights (no gradient), so this compares "
            f"the loss and the gradients of the {len(trainable)} trainable parameters ({', '.join(kinds)}); "
            "those gradients flow back through every GPTQ layer's dequantizing backward. The rules checked are "
            "the full fine-tuning ones; LoRA adapters (fused_lora) are not part of foak verify")


def format_rows(rows: list[VerifyRow]) -> str:
    header = ("rule", "modules", "loss rel. error", "max grad rel. error*", "worst parameter", "tolerance", "result")
    body = [(r.name, str(r.modules), f"{r.loss_error:.2e}", f"{r.grad_error:.2e}", r.worst_param,
             f"{r.tolerance:.0e}", "PASS" if r.passed else "FAIL") for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *body])
