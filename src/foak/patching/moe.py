"""``fast_moe``: transformers' MoE experts modules run foak's ``moe_experts`` op (foak.ops.moe).

transformers 5.x experts classes (MixtralExperts, Qwen3MoeExperts, GraniteMoeExperts: decorated with
``transformers.integrations.moe.use_experts_implementation``) choose their computation at call time: the
class forward looks ``config._experts_implementation`` up in ``ALL_EXPERTS_FUNCTIONS`` ("eager" is the
class's own loop over experts; "grouped_mm", "batched_mm", ...). This rule gives each experts module foak's
forward on the instance (bound to it, like every foak forward): nothing global is registered and the config
(which several models built from one config object share) is not written, so every other model, and every
module foak did not patch, dispatches exactly as before. ``foak.restore`` removes the instance forwards.
Parameters, modules and ``state_dict()`` are untouched; the routers (and so the auxiliary load-balancing
loss) stay transformers' own.

foak's forward decides per call. It runs ``moe_experts`` when that computes exactly what the experts module
would: gated experts with the gate|up rows concatenated in ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``, no biases, no post-expert norm, transformers' default gating
(``act(gate) * up``), an activation foak has (by the type of ``act_fn``: SiLU; exact GELU; tanh GELU, also
in its NewGELU/FastGELU forms), plain dense weights and no expert parallelism. Anything else runs the
module's own forward (the implementation its config names: ``eager``, ``grouped_mm``, ...) and is counted in
the report row with the reason; a module that fails a static condition is not patched at all ("not patched:
expert biases").

An experts class with its own gating (``_apply_gate``) that ``moe_experts`` computes is registered by its
architecture's rule (``moe_experts_rule(..., gate=CustomGate(...))``): gpt-oss's clamped SwiGLU on interleaved
gate/up columns, transposed weights and biases. Such a module runs foak's op only with exactly the layout
flags its gate and forward assume, both biases present, and its gate parameters (``alpha``, ``limit``) finite
numbers; a subclass that overrides ``_apply_gate`` is not registered and keeps its own forward.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from foak.ops.moe import moe_experts
from foak.patching.rules import CallCounts, Rule, Skip, Trigger, call_next

_HF_MOE: list = []  # [the module or None], found once (at patch time: support() reads it per call, also traced)


def _hf_moe():
    """transformers.integrations.moe, or None where the installed transformers has no experts interface."""
    if not _HF_MOE:
        try:
            from transformers.integrations import moe
        except ImportError:
            moe = None
        _HF_MOE.append(moe if hasattr(moe, "ALL_EXPERTS_FUNCTIONS") else None)
    return _HF_MOE[0]


# ---- the activation, exactly ------------------------------------------------------------------------


def _activation_table() -> dict[type, str]:
    from transformers import activations as acts

    table = {nn.SiLU: "silu"}
    for name, activation in (("SiLUActivation", "silu"),
                             ("GELUActivation", "gelu"),  # erf GELU, C or Python form
                             ("GELUTanh", "gelu_tanh"), ("PytorchGELUTanh", "gelu_tanh"),  # tanh GELU, C or Python
                             # the same tanh formula; FastGELU's constant is sqrt(2/pi) to 10 digits (3e-12
                             # relative, far below fp32's resolution)
                             ("NewGELUActivation", "gelu_tanh"), ("FastGELUActivation", "gelu_tanh")):
        cls = getattr(acts, name, None)
        if isinstance(cls, type):
            table[cls] = activation
    return table


_ACTIVATIONS: dict[type, str] | None = None


def activation_of(act_fn) -> tuple[str | None, str | None]:
    """(moe_experts activation, None) for an experts module's ``act_fn``, or (None, why not)."""
    global _ACTIVATIONS
    if _ACTIVATIONS is None:
        _ACTIVATIONS = _activation_table()
    if type(act_fn) is nn.GELU:
        name = {"none": "gelu", "tanh": "gelu_tanh"}.get(act_fn.approximate)
    else:
        name = _ACTIVATIONS.get(type(act_fn))
    if name is None:
        return None, f"activation {type(act_fn).__name__} has no foak kernel (SiLU, GELU, tanh GELU)"
    if isinstance(act_fn, nn.Module) and ("forward" in vars(act_fn) or act_fn._forward_hooks
                                          or act_fn._forward_pre_hooks):
        return None, f"activation {type(act_fn).__name__} with a replaced forward or hooks"
    return name, None


# ---- what the op can compute --------------------------------------------------------------------------


def _dispatch_reason(module: nn.Module) -> str | None:
    """Why selecting an implementation on this module's config would not reach it (None: it would)."""
    forward = getattr(type(module), "forward", None)
    if getattr(forward, "__wrapped__", None) is None or not hasattr(module, "has_gate") or not hasattr(module,
                                                                                                      "config"):
        return "its forward does not dispatch through transformers' experts interface (use_experts_implementation)"
    if "forward" in vars(module):
        return "its forward is replaced on the instance"
    return None


_LAYOUT = (  # (attribute, value foak needs, default where this transformers lacks it, reason otherwise)
    ("has_gate", True, True, "experts without a gate (up_proj only)"),
    ("is_concatenated", True, True, "interleaved gate/up rows in gate_up_proj"),
    ("is_transposed", False, False, "transposed expert weights"),
    ("has_bias", False, False, "expert biases"),
    ("has_post_expert_norm", False, False, "a post-expert norm"),
    ("_is_expert_parallel", False, False, "expert parallelism (expert ids beyond the local experts)"),
)


class CustomGate(NamedTuple):
    """An experts class's own ``_apply_gate`` that ``moe_experts`` computes as ``activation``, with the layout
    flags the class must carry (its eager forward and gate assume them) and the module attributes passed on
    to ``moe_experts`` as keywords of the same names (``alpha``, ``limit``)."""

    activation: str
    is_concatenated: bool
    is_transposed: bool
    has_bias: bool
    params: tuple[str, ...] = ()


_CUSTOM_GATES: dict = {}  # the class's _apply_gate function -> CustomGate (filled by moe_experts_rule)


def _custom_gate(module: nn.Module) -> CustomGate | None:
    return _CUSTOM_GATES.get(getattr(type(module), "_apply_gate", None))


def _custom_gate_reason(module: nn.Module, gate: CustomGate) -> str | None:
    for attribute, needed in (("is_concatenated", gate.is_concatenated), ("is_transposed", gate.is_transposed),
                              ("has_bias", gate.has_bias)):
        if bool(getattr(module, attribute, not needed)) != needed:
            return f"{attribute}={not needed} with {type(module).__name__}'s own gate (it assumes {needed})"
    for name in gate.params:
        value = getattr(module, name, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{type(module).__name__}.{name} is not a finite number ({value!r})"
    if gate.has_bias:
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            b = getattr(module, name, None)
            if not isinstance(b, torch.Tensor) or not b.is_floating_point() or b.dim() != 2 \
                    or type(b) not in (torch.Tensor, nn.Parameter):
                return f"{name} is not a plain 2-d floating-point tensor ({type(b).__name__})"
    return None


def moe_options(module: nn.Module) -> dict:
    """The keywords of ``moe_experts`` beyond the activation for this (supported) experts module."""
    gate = _custom_gate(module)
    if gate is None:
        return {}
    options = {"interleaved": not gate.is_concatenated, "transposed": gate.is_transposed}
    if gate.has_bias:
        options.update(gate_up_bias=module.gate_up_proj_bias, down_bias=module.down_proj_bias)
    options.update({name: float(getattr(module, name)) for name in gate.params})
    return options


def support(module: nn.Module) -> tuple[str | None, str | None]:
    """(activation, None) when ``moe_experts`` computes exactly this experts module's forward, else
    (None, the reason). Cheap: read at patch time and again at every call."""
    gate = _custom_gate(module)
    for attribute, needed, default, why in _LAYOUT:
        if gate is not None and attribute in ("is_concatenated", "is_transposed", "has_bias"):
            continue  # checked against the gate's own layout below
        if bool(getattr(module, attribute, default)) != needed:
            return None, why
    if gate is not None:
        reason = _custom_gate_reason(module, gate)
        if reason is not None:
            return None, reason
    distributed = getattr(getattr(module, "config", None), "distributed_config", None)
    if getattr(distributed, "enable_expert_parallel", False):
        return None, "expert parallelism (distributed_config.enable_expert_parallel)"
    moe = _hf_moe()
    default_gate = getattr(moe, "_default_apply_gate", None)
    own_gate = getattr(type(module), "_apply_gate", None)
    if gate is None and default_gate is not None and own_gate is not None and own_gate is not default_gate:
        return None, f"a custom gating ({type(module).__name__}._apply_gate)"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 3:
            return None, f"{name} is not a 3-d floating-point tensor ({type(w).__name__})"
        if type(w) not in (torch.Tensor, nn.Parameter):
            return None, f"{name} is a {type(w).__name__} (sharded or quantized expert weights)"
    transposed = gate is not None and gate.is_transposed
    if transposed:
        E, H, two_i = gate_up.shape
        down_shape = (E, two_i // 2, H)
    else:
        E, two_i, H = gate_up.shape
        down_shape = (E, H, two_i // 2)
    if two_i % 2 or tuple(down.shape) != down_shape or getattr(module, "num_experts", E) != E:
        return None, (f"expert weights of shapes {tuple(gate_up.shape)} / {tuple(down.shape)} for "
                      f"{getattr(module, 'num_experts', '?')} experts (foak takes "
                      f"{'[E, H, 2I] / [E, I, H]' if transposed else '[E, 2I, H] / [E, H, I]'})")
    if gate is not None:
        if gate.has_bias and (tuple(module.gate_up_proj_bias.shape) != (E, two_i)
                              or tuple(module.down_proj_bias.shape) != (E, H)):
            return None, (f"expert biases of shapes {tuple(module.gate_up_proj_bias.shape)} / "
                          f"{tuple(module.down_proj_bias.shape)} (foak takes [E, 2I] / [E, H])")
        return gate.activation, None
    return activation_of(getattr(module, "act_fn", None))


# ---- call counts (what really ran), shown in the rule's report row ------------------------------------


class _Counts(CallCounts):
    def __init__(self, row):
        super().__init__(row)
        self.foak, self.other, self.previous = 0, {}, set()

    def count(self, reason: str | None, previous: str) -> None:
        if not self.counting():
            return
        if reason is None:
            self.foak += 1
        else:
            self.bump(self.other, reason)
            self.previous.add(previous)
        text = f"foak moe_experts ran {self.foak} call{'s' if self.foak != 1 else ''}"
        if self.other:
            total = sum(self.other.values())
            reasons = ", ".join(f"{why} ({n})" for why, n in sorted(self.other.items()))
            text += (f"; the previous implementation ({'/'.join(sorted(self.previous))}) ran {total} "
                     f"call{'s' if total != 1 else ''}: {reasons}")
        self.show(text)


def _counts_of(state, rule_id: str) -> _Counts:
    return _Counts.of(state, rule_id)


def moe_counts(report, rule_id: str) -> tuple[int, dict[str, int]]:
    """(calls foak's moe_experts ran, {reason: calls the previous implementation ran}) of a report's MoE row."""
    counts = _Counts.find(report, rule_id)
    return (0, {}) if counts is None else (counts.foak, dict(counts.other))


# ---- the experts forward ------------------------------------------------------------------------------


def _configured_implementation(module: nn.Module) -> str:
    return str(getattr(getattr(module, "config", None), "_experts_implementation", None) or "eager")


def experts_rule_forward(rule_id: str, counts: _Counts):
    """The forward of a patched experts module (transformers' experts signature). It runs ``moe_experts`` when
    that computes exactly what the module would, else the module's own forward, which dispatches on its
    config's ``_experts_implementation`` as before (counted with the reason)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        activation, reason = support(self)
        if reason is not None:
            out = call_next(self, rule_id, hidden_states, top_k_index, top_k_weights)
            counts.count(reason, _configured_implementation(self))
            return out
        out = moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, activation,
                          **moe_options(self))
        counts.count(None, _configured_implementation(self))
        # transformers' implementations return hidden_states' dtype (the op returns the autocast dtype under autocast)
        return out.to(hidden_states.dtype)

    return forward


class _NoExpertsClass(nn.Module):
    """Trigger class where the installed transformers has no fused experts class (the rule is skipped)."""


def moe_experts_rule(arch: str, modeling, experts_class_name: str, gate: CustomGate | None = None) -> Rule:
    """The ``fast_moe`` rule of an architecture whose modeling module defines ``experts_class_name``: each
    experts module gets foak's forward on the instance (its config, which other models built from the same
    config object share, is not touched). ``gate``: the class's own ``_apply_gate`` is this CustomGate."""
    experts_class = getattr(modeling, experts_class_name, None)
    if gate is not None and experts_class is not None and "_apply_gate" in vars(experts_class):
        _CUSTOM_GATES[vars(experts_class)["_apply_gate"]] = gate
    rule_id = f"{arch}.moe"

    def skip_reason(model):
        if experts_class is None:
            return f"{modeling.__name__} has no {experts_class_name} (fused experts) class"
        if _hf_moe() is None:
            return "this transformers has no experts interface (transformers.integrations.moe)"
        return None

    def patch(module, model, state):
        reason = _dispatch_reason(module)
        if reason is None:
            _, reason = support(module)
        if reason is not None:  # left as it is
            return Skip(reason)
        return experts_rule_forward(rule_id, _counts_of(state, rule_id))

    return Rule(rule_id, "moe", Trigger(experts_class or _NoExpertsClass), patch, skip_reason)
