"""Rules for PEFT models: the one module of foak that knows PEFT's classes (peft is imported only if the
process already imported it: a model can only hold PEFT layers then).

``fused_lora``: every PEFT LoRA layer over a base foak's ops take (foak.patching.lora_bases: a plain
``nn.Linear`` under ``lora.Linear``, a bitsandbytes NF4 ``Linear4bit`` under ``lora.bnb.Linear4bit``; the
base is detected from the model) gets a forward that decides per call. When PEFT's own forward would compute exactly ``base(x) + s * B(A(dropout(x)))`` for one
adapter, foak's ``lora_linear`` computes it (the dropout mask is foak's, drawn from torch's generator, not
PEFT's ``nn.Dropout`` mask). Anything else takes PEFT's own forward, unchanged: adapters disabled, a merged
adapter, no or several active adapters, DoRA or another LoRA variant, ``lora_bias``, extra arguments
(``adapter_names``...), a dropout module other than ``nn.Dropout`` / ``nn.Identity``, hooks on the
sub-layers, a trainable base weight, dtypes foak's op does not take. The rule's report row counts the
fused and the fallen-back calls, with the reasons. Parameters, buffers and state_dict are untouched.
A 4-bit base also takes PEFT's path for dtypes bitsandbytes would round differently (see
lora_bases). LoRA layers over other bases (8-bit, FP4, GPTQ...) are left to PEFT and named in the report.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch import nn

from foak.ops.activations import glu
from foak.ops.glu_linear import glu_linear
from foak.ops.lora import lora_linear, lora_linears
from foak.ops.lora_glu_linear import lora_glu_linear
from foak.patching.lora_bases import format_of
from foak.patching.replacements import _plain_linear
from foak.patching.rules import CallCounts, Rule, Trigger, forward_link, call_next


def _lora_layer_module():
    """peft.tuners.lora.layer if peft was imported (None otherwise: no model can hold PEFT layers)."""
    return sys.modules.get("peft.tuners.lora.layer")


def is_peft_model(model: nn.Module) -> bool:
    """A PeftModel, or a model holding PEFT tuner layers (peft.inject_adapter_in_model)."""
    peft = sys.modules.get("peft")
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if peft is None or tuners is None:
        return False
    if isinstance(model, peft.PeftModel):
        return True
    return any(isinstance(m, tuners.BaseTunerLayer) for m in model.modules())


def _peft_skip_reason(model) -> str | None:
    """Why the fused_lora rules cannot apply at all (shared by the layer and the q/k/v block rules)."""
    if _lora_layer_module() is None:
        return ("peft is not imported: the model has no PEFT LoRA layers (layers added later, e.g. by "
                "peft.get_peft_model, are fused from the model's next forward)")
    return None


def _fusable_layer(module: nn.Module) -> bool:
    fmt = format_of(module)
    return fmt is not None and fmt.patch_reason(module.base_layer) is None


def _no_hooks(module: nn.Module) -> bool:
    return ("forward" not in module.__dict__ and not module._forward_hooks and not module._forward_pre_hooks
            and not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks)


def _describe(model: nn.Module) -> str | None:
    """Which LoRA layers the rule leaves to PEFT at patch time, and why."""
    layer = _lora_layer_module()
    if layer is None:
        return None
    others: dict[str, int] = {}
    fused: dict[str, int] = {}
    for m in model.modules():
        if not isinstance(m, layer.LoraLayer):
            continue
        fmt = format_of(m)
        why = fmt.patch_reason(m.base_layer) if fmt is not None else None
        if fmt is not None and why is None:
            fused[fmt.name] = fused.get(fmt.name, 0) + 1
            continue
        base, name = type(getattr(m, "base_layer", None)).__name__, type(m).__name__
        kind = (name if name == base else f"{name} over {base}") + f" ({why or 'no fused kernel for this base yet'})"
        others[kind] = others.get(kind, 0) + 1
    notes = []
    if len(fused) > 1 or (fused and "nn.Linear" not in fused):
        notes.append("bases: " + ", ".join(f"{n} {name}" for name, n in sorted(fused.items())))
    if others:
        notes.append("left to PEFT: " + ", ".join(f"{n} {kind}" for kind, n in sorted(others.items())))
    if notes:
        return "; ".join(notes)
    if not any(isinstance(m, layer.LoraLayer) for m in model.modules()):
        return ("the model has no PEFT LoRA layers yet (layers added later, e.g. by peft.get_peft_model, are fused "
                "from the model's next forward)")
    return None


class _Counts(CallCounts):
    """Fused and fallen-back calls of one rule on one model, shown in its report row (a copy of a patched
    layer counts into the same row)."""

    def __init__(self, row, rule_id: str = ""):
        super().__init__(row)
        self.fused, self.fp32, self.peft, self.rule_id = 0, 0, {}, rule_id

    def count(self, reason: str | None, fp32_adapters: bool = False) -> None:
        if not self.counting():
            return
        if reason is None:
            self.fused += 1
            self.fp32 += fp32_adapters
        else:
            self.bump(self.peft, reason)
        text = f"fused {self.fused} call{'s' if self.fused != 1 else ''}"
        if self.fp32:
            text += (f" ({self.fp32} with fp32 adapters on 16-bit activations outside autocast: fp32 adapter math; "
                     "under autocast it is bf16)")
        if self.peft:
            total = sum(self.peft.values())
            reasons = ", ".join(f"{why} ({n})" for why, n in sorted(self.peft.items()))
            text += f"; PEFT's path {total} call{'s' if total != 1 else ''}: {reasons}"
        self.show(text)


def _counts_of(state, rule_id: str) -> _Counts:
    return _Counts.of(state, rule_id, rule_id)


def fused_lora_counts(report, rule_id: str) -> tuple[int, dict[str, int]]:
    """(fused calls, {reason: PEFT-path calls}) of a report's fused_lora row so far ((0, {}) if it ran none)."""
    counts = _Counts.find(report, rule_id)
    return (0, {}) if counts is None else (counts.fused, dict(counts.peft))


def _fallback_reason(module, x, args, kwargs) -> str | None:
    """Why PEFT's own forward must run for this call (None: foak's lora_linear computes it exactly)."""
    if module.disable_adapters:
        return "adapters disabled"
    if module.merged:
        return "merged adapter"
    if "adapter_names" in kwargs:
        return "adapter_names"
    if args or kwargs:
        return "extra arguments"
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1:
        return f"{len(active)} active adapters"
    (name,) = active
    if getattr(module, "use_dora", {}).get(name, False):
        return "DoRA"
    if name in getattr(module, "lora_variant", {}):
        return f"LoRA variant {type(module.lora_variant[name]).__name__}"
    lora_A, lora_B, dropout = module.lora_A[name], module.lora_B[name], module.lora_dropout[name]
    if getattr(module, "lora_bias", {}).get(name, False) or lora_B.bias is not None or lora_A.bias is not None:
        return "lora_bias"
    if type(dropout) not in (nn.Identity, nn.Dropout):
        return f"dropout module {type(dropout).__name__}"
    base = module.base_layer
    fmt = format_of(module)
    if fmt is None:
        return f"base layer {type(base).__name__}"
    if not (_no_hooks(base) and _plain_linear(lora_A) and _plain_linear(lora_B) and _no_hooks(dropout)):
        return "hooks or non-plain sub-layers"
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return "non-float input"
    weight = getattr(base, "weight", None)  # (a GPTQ base holds buffers only)
    if (weight is not None and weight.requires_grad) or (base.bias is not None and base.bias.requires_grad):
        return "trainable base layer"
    adapter_dtype = lora_A.weight.dtype
    if lora_B.weight.dtype != adapter_dtype:
        return "mixed adapter dtypes"
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type) and adapter_dtype not in (torch.float32,
                                                                         torch.get_autocast_dtype(device_type)):
        return f"{adapter_dtype} adapters under autocast"
    reason = fmt.call_reason(base, x)
    if reason is not None:
        return reason
    if x.dtype != adapter_dtype and not getattr(module, "cast_input_dtype_enabled", True):
        return "input dtype casting disabled"
    return None


# a LoRA layer the fused_lora rule patched holds its rule's counts under this attribute (copies of the layer
# too); a block-level rule (the gated MLP's) asks :func:`fused_projection` whether a layer's call may run
# inside its own fused op
_COUNTS_ATTR = "_foak_lora_counts"


def _layer_counts(module) -> _Counts | None:
    """The counts of the fused_lora rule whose forward ``module`` holds (None: not a patched LoRA layer)."""
    counts = getattr(module, "__dict__", {}).get(_COUNTS_ATTR)
    return counts if counts is not None and forward_link(module, counts.rule_id) else None


def is_fused_lora_layer(module) -> bool:
    return _layer_counts(module) is not None


def _active_adapter(module) -> str:
    """The name of the one active adapter of a layer whose calls are fused (_fallback_reason checked there is one)."""
    (name,) = [a for a in module.active_adapters if a in module.lora_A]
    return name


def _projection_spec(module, x):
    """(weight, bias, lora_A, lora_B, scaling, dropout_p, seed) of the one active adapter, for foak.ops.lora."""
    name = _active_adapter(module)
    dropout = module.lora_dropout[name]
    p = float(dropout.p) if isinstance(dropout, nn.Dropout) and dropout.training else 0.0
    base = module.base_layer
    return (format_of(module).weight(base), base.bias, module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name],
            p, None)


def fused_projection(module: nn.Module, x: torch.Tensor):
    """For a block-level op (e.g. the gated MLP's): the ``lora_linear`` arguments of ``module(x)`` as a
    ``(weight, bias, lora_A, lora_B, scaling, dropout_p, seed)`` tuple when ``module`` is a layer the
    fused_lora rule patched and this call would be fused; else None (then call ``module(x)``, which takes
    and counts its own path). A caller that uses the tuple reports it with :func:`count_fused`."""
    if _layer_counts(module) is None or _fallback_reason(module, x, (), {}) is not None:
        return None
    return _projection_spec(module, x)


def count_fused(module: nn.Module, x: torch.Tensor) -> None:
    """Count one fused call (input ``x``) of a layer whose :func:`fused_projection` a block-level op computed."""
    _layer_counts(module).count(None, _fp32_adapter_math(module, x))


def _fp32_adapter_math(module, x) -> bool:
    """fp32 adapters on a 16-bit input outside autocast: PEFT's (and foak's) adapter products run in fp32."""
    return (x.dtype in (torch.bfloat16, torch.float16)
            and module.lora_A[_active_adapter(module)].weight.dtype == torch.float32
            and not torch.is_autocast_enabled(x.device.type))


# q/k/v outputs that an attention block computed as one lora_linears call, each waiting for its projection's
# own call with the same input tensor (then returned, and counted as that layer's fused call)
_PREFETCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
QKV = ("q_proj", "k_proj", "v_proj")


def lora_attention_rule(arch: str, attention_class: type) -> Rule:
    """fused_lora's attention block: when the q, k and v projections of an attention module are layers the
    fused_lora rule patched and each would be fused for the module's input, they run as one
    ``lora_linears`` call (x read and saved once, one input gradient, one mask per projection; without
    dropout one GEMM for the three down-projections). The attention forward itself is the model's own: its
    ``q_proj(hidden_states)`` calls receive the block's outputs (matched by the input tensor's identity).
    A block output its projection did not ask for would be wasted work: it is counted in the row."""
    rule_id = f"{arch}.fused_lora_qkv"

    def patch(module, model, state):
        row = state.result
        counts = row.__dict__.setdefault("block_counts", {"blocks": 0, "unused": 0})  # one per row, all modules

        def forward(self, *args, **kwargs):
            projections = [getattr(self, name) for name in QKV]
            x = args[0] if args else kwargs.get("hidden_states")
            if torch.compiler.is_compiling() or not isinstance(x, torch.Tensor):
                return call_next(self, rule_id, *args, **kwargs)
            specs = [fused_projection(m, x) for m in projections]
            if any(spec is None for spec in specs):
                return call_next(self, rule_id, *args, **kwargs)
            for m, out in zip(projections, lora_linears(x, specs)):
                _PREFETCHED[m] = (x, out)
            try:
                return call_next(self, rule_id, *args, **kwargs)
            finally:
                unused = sum(_PREFETCHED.pop(m, None) is not None for m in projections)
                counts["blocks"] += 1
                counts["unused"] += unused
                text = f"{counts['blocks']} forwards with q/k/v as one fused LoRA block"
                if counts["unused"]:
                    text += (f"; {counts['unused']} block outputs were not asked for by their projection (the "
                             "attention forward projected another tensor): wasted work, disable fused_lora_qkv")
                row.note_runtime("blocks", text)

        return forward

    def is_lora_attention(m, model):
        return all(_fusable_layer(getattr(m, name, None)) for name in QKV)

    def skip_reason(model):
        attention = next((m for m in model.modules() if isinstance(m, attention_class)), None)
        if attention is not None and hasattr(attention, "qkv_proj") and not hasattr(attention, "q_proj"):
            return ("q, k and v come from one fused projection (qkv_proj): fused_lora fuses its LoRA layer as one "
                    "lora_linear call")
        return _peft_skip_reason(model)

    def describe(model):
        modules = list(model.modules())
        if any(is_lora_attention(m, model) for m in modules if isinstance(m, attention_class)) or \
                not any(_fusable_layer(m) for m in modules):
            return None
        return ("q_proj, k_proj and v_proj are not all LoRA layers fused_lora fuses (e.g. LoRA on some of them "
                "only): each LoRA projection runs as its own fused_lora call")

    return Rule(rule_id, "lora", Trigger(attention_class, predicate=is_lora_attention), patch, skip_reason, describe)


def lora_glu_mlp(gate: nn.Module, up: nn.Module, down: nn.Module, x: torch.Tensor, activation: str):
    """``down(act(gate(x)) * up(x))`` with the fused_lora layers among the three computed as blocks: gate and
    up by one ``lora_linears`` (x read once, each its own dropout mask), down by ``lora_glu_linear`` (the
    product ``act(g) * u`` recomputed in the backward, not kept). A layer whose call PEFT's path must take
    runs its own forward. Returns None when none of the blocks applies (the caller's own MLP path runs).
    ``up=None``: ``gate`` is one fused [gate; up] projection (Phi-3's ``gate_up_proj``), which runs its own
    forward (fused_lora fuses its LoRA layer as one call); the block is then down's alone."""
    if up is None:
        if _layer_counts(down) is None:
            return None
        g, u = gate(x).chunk(2, dim=-1)
    else:
        spec_gate, spec_up = fused_projection(gate, x), fused_projection(up, x)
        pair = spec_gate is not None and spec_up is not None
        if not pair and _layer_counts(down) is None:
            return None
        if pair:
            g, u = lora_linears(x, [spec_gate, spec_up])
            count_fused(gate, x)
            count_fused(up, x)
        else:
            g, u = gate(x), up(x)
    spec_down = fused_projection(down, g)
    if spec_down is not None:
        weight, bias, lora_A, lora_B, scaling, p, _ = spec_down
        count_fused(down, g)
        return lora_glu_linear(g, u, weight, bias, lora_A, lora_B, scaling, dropout_p=p, activation=activation)
    if _plain_linear(down):
        return glu_linear(g, u, down.weight, down.bias, activation)
    return down(glu(g, u, activation))  # e.g. a LoRA layer whose call takes PEFT's path (counted there)


def lora_linear_rule(arch: str) -> Rule:
    """fused_lora: PEFT LoRA layers over a base of foak.patching.lora_bases run foak's ``lora_linear`` when
    that computes exactly what PEFT would (decided per call; see the module docstring)."""
    rule_id = f"{arch}.fused_lora"

    def patch(module, model, state):
        counts = _counts_of(state, rule_id)
        module.__dict__[_COUNTS_ATTR] = counts
        state.on_restore(lambda: module.__dict__.pop(_COUNTS_ATTR, None))

        def forward(self, x, *args, **kwargs):
            entry = _PREFETCHED.get(self)  # computed by a block op (q/k/v) for exactly this input
            if entry is not None and entry[0] is x and not args and not kwargs:
                del _PREFETCHED[self]
                counts.count(None, _fp32_adapter_math(self, x))
                return entry[1]
            reason = _fallback_reason(self, x, args, kwargs)
            counts.count(reason, reason is None and _fp32_adapter_math(self, x))
            if reason is not None:
                return call_next(self, rule_id, x, *args, **kwargs)
            weight, bias, lora_A, lora_B, scaling, p, _ = _projection_spec(self, x)
            return lora_linear(x, weight, bias, lora_A, lora_B, scaling, dropout_p=p)

        return forward

    layer = _lora_layer_module()
    module_class = layer.LoraLayer if layer is not None else nn.Linear
    trigger = Trigger(module_class, predicate=lambda m, model: _fusable_layer(m))
    return Rule(rule_id, "lora", trigger, patch, _peft_skip_reason, _describe)


# the gated-MLP rule (foak.patching.replacements) asks these per call
from foak.patching import replacements as _replacements  # noqa: E402

if not _replacements.PEFT_MLP:
    _replacements.PEFT_MLP.append((is_fused_lora_layer, lora_glu_mlp))
