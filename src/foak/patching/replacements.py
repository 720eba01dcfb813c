"""Rule factories for the patterns decoder LLMs share; models/ files combine them per architecture.

Each factory returns Rules whose ``patch`` builds a replacement forward around foak's ops. They rely on
the module's own attributes (``weight``, ``gate_proj``...) and never copy a HuggingFace forward: the RoPE
and loss rules wrap the original forward and change only the one call they accelerate.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref

import torch
from torch import nn

from foak.ops.activations import glu
from foak.ops.cross_entropy import cross_entropy
from foak.ops.glu_linear import glu_linear
from foak.ops._recompute import recomputing_outputs
from foak.ops.linear_cross_entropy import linear_cross_entropy
from foak.ops.rms_norm import rms_norm
from foak.ops.rope import rope
from foak.patching.autocast import cast_first_argument, cast_for_projections
from foak.patching import globals as globals_
from foak.patching.rules import Rule, SharedAcrossCopies, Skip, Trigger, at_trace_time, call_next

# ---- RMSNorm ---------------------------------------------------------------------------------------


def rms_norm_rule(arch: str, norm_class: type, mode: str = "llama") -> Rule:
    def patch(module, model, state):
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None:
            raise ValueError(f"{arch}.rms_norm: {type(module).__name__} has no variance_epsilon/eps attribute")

        if getattr(module, "weight", None) is None:  # a norm without a scale (Gemma 4's with_scale=False)
            unit = 0.0 if mode == "gemma" else 1.0

            def forward(self, hidden_states):
                weight = torch.full(hidden_states.shape[-1:], unit, dtype=hidden_states.dtype,
                                    device=hidden_states.device)
                return rms_norm(hidden_states, weight, eps, mode, inplace_backward=False)

            return forward

        def forward(self, hidden_states):
            # out-of-place backward: a decoder layer's input is also saved by activation checkpointing,
            # so writing dx into it would break (loudly) HF's gradient checkpointing
            return rms_norm(hidden_states, self.weight, eps, mode, inplace_backward=False)

        return forward

    return Rule(f"{arch}.rms_norm", "rms_norm", Trigger(norm_class), patch)


def rms_norm_recompute_rule(arch: str, stack_class: type) -> Rule:
    """Within the decoder stack's forward, the projections that read an RMSNorm's output save it as a
    recipe (recomputed in the backward from what the norm keeps anyway) rather than as a second copy of
    every layer's hidden states (foak.ops._recompute). Scoped at the stack, outside every layer, so that
    gradient checkpointing's own saved-tensor hooks take precedence inside checkpointed layers. Under
    saved-tensor hooks that are active around the stack (save_on_cpu, activation offloading) the scope
    steps aside (foak.ops._recompute.recomputing_outputs) and the rule's report row says how often."""

    rule_id = f"{arch}.rms_norm_recompute"

    def patch(module, model, state):
        row, counts = state.result, {"forwards": 0, "aside": 0}

        def forward(self, *args, **kwargs):
            if torch.compiler.is_compiling():  # the compiler plans recomputation itself
                return call_next(self, rule_id, *args, **kwargs)
            scope = recomputing_outputs()
            with scope:
                out = call_next(self, rule_id, *args, **kwargs)
            counts["forwards"] += 1
            if scope.stepped_aside is not None:
                counts["aside"], counts["why"] = counts["aside"] + 1, scope.stepped_aside
            if counts["aside"]:  # the last reason; a plain note while the scope always acted
                row.note_runtime("stepped_aside", f"recompute stepped aside in {counts['aside']} of "
                                 f"{counts['forwards']} forwards ({counts['why']})")
            return out

        return forward

    return Rule(rule_id, "rms_norm", Trigger(stack_class), patch)


def rms_norm_gated_rule(arch: str, norm_class: type) -> Rule:
    """A gated RMSNorm ``forward(x, gate)`` of HF's form (Qwen3.5's, inside the gated delta net):
    ``(weight * normalise(x.float()).to(x.dtype)) * silu(gate.float())`` cast to x's dtype. The norm is foak's
    rms_norm (llama mode: the same casts); the gate product is foak's glu when gate, x and the normed output
    share one dtype (then ``glu``'s fp32 product and cast are HF's exactly), else the same product in torch."""

    def patch(module, model, state):
        activation = getattr(module, "activation", None)
        if activation not in ("silu", "swish"):
            return Skip(f"gate activation {activation!r} (foak's gated norm takes silu)")
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None:
            return Skip(f"{type(module).__name__} has no variance_epsilon/eps attribute")

        def forward(self, hidden_states, gate):
            y = rms_norm(hidden_states, self.weight, eps, "llama", inplace_backward=False)
            if y.dtype == gate.dtype == hidden_states.dtype:
                return glu(gate, y, "silu", inplace_backward=False)
            return (y * nn.functional.silu(gate.float())).to(hidden_states.dtype)

        return forward

    return Rule(f"{arch}.rms_norm_gated", "rms_norm", Trigger(norm_class), patch)


# ---- gated MLP ---------------------------------------------------------------------------------------
# HF activation names -> foak.ops.activations.glu activations
GLU_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                   "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def _hidden_act(model: nn.Module) -> str:
    config = model.config
    for c in (config, config.get_text_config() if hasattr(config, "get_text_config") else config):
        act = getattr(c, "hidden_act", None) or getattr(c, "hidden_activation", None)
        if act:  # a multimodal model: its text config's
            return act
    return ""


def _plain_linear(module: nn.Module) -> bool:
    """An nn.Linear whose forward is exactly ``F.linear(x, weight, bias)``: no subclass, no hooks."""
    return (type(module) is nn.Linear and "forward" not in module.__dict__ and not module._forward_hooks
            and not module._forward_pre_hooks and not nn.modules.module._global_forward_hooks
            and not nn.modules.module._global_forward_pre_hooks)


def _glu_skip_reason(model):
    act = _hidden_act(model)
    if act not in GLU_ACTIVATIONS:
        return f"hidden_act {act!r} has no fused gated kernel (supported: {sorted(GLU_ACTIVATIONS)})"
    return None


# (is_fused_lora_layer, lora_glu_mlp) of foak.patching.peft, which registers them here when it is imported
# (it imports this module): read per call, without an import or a sys.modules lookup that tracing would see
PEFT_MLP: list = []


def _lora_glu_mlp(mlp: nn.Module, projections=("gate_proj", "up_proj", "down_proj")):
    """foak.patching.peft.lora_glu_mlp when one of the MLP's projections is a LoRA layer that fused_lora
    patched (decided per call: LoRA layers may be added, and fused, after the MLP was patched), else None."""
    if not PEFT_MLP:
        return None
    is_fused_lora_layer, lora_glu_mlp = PEFT_MLP[0]
    if any(is_fused_lora_layer(getattr(mlp, name)) for name in projections):
        return lora_glu_mlp
    return None


def glu_mlp_rule(arch: str, mlp_class: type) -> Rule:
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with act and product fused (SwiGLU / GeGLU). When
    down_proj is a plain nn.Linear, the product is not kept for the backward (foak.ops.glu_linear). When the
    projections are PEFT LoRA layers patched by fused_lora, the MLP runs as fused LoRA blocks
    (foak.patching.peft.lora_glu_mlp: gate and up as one op, down without keeping the product): one rule
    for the MLP, decided per call, with the LoRA layers' own counts in the fused_lora row."""

    def patch(module, model, state):
        activation = GLU_ACTIVATIONS[_hidden_act(model)]
        row = state.result
        blocks = row.__dict__.setdefault("block_counts", [0])  # one count per row, summed over its modules

        def forward(self, x):
            down = self.down_proj
            # under autocast over fp32 weights: one cast for gate and up, unless they are quantized (autocast.py)
            x = cast_for_projections(x, (self.gate_proj, self.up_proj))
            lora_mlp = _lora_glu_mlp(self)
            if lora_mlp is not None:  # PEFT LoRA projections that fused_lora patched: fused LoRA blocks
                out = lora_mlp(self.gate_proj, self.up_proj, down, x, activation)
                if out is not None:
                    if not torch.compiler.is_compiling():
                        blocks[0] += 1
                        row.note_runtime("lora_blocks", f"{blocks[0]} forwards as fused LoRA MLP blocks")
                    return out
            g, u = self.gate_proj(x), self.up_proj(x)
            if _plain_linear(down):  # the product is recomputed in the backward instead of kept
                return glu_linear(g, u, down.weight, down.bias, activation)
            return down(glu(g, u, activation))  # e.g. a PEFT LoRA or quantized layer: its own forward

        return forward

    has_projections = lambda m, model: all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj"))
    return Rule(f"{arch}.swiglu", "swiglu", Trigger(mlp_class, predicate=has_projections), patch, _glu_skip_reason)


def fused_glu_mlp_rule(arch: str, mlp_class: type, gate_up: str = "gate_up_proj", down: str = "down_proj") -> Rule:
    """The gated MLP with one fused gate/up projection (Phi-3's and GLM-4's ``gate_up_proj``, GraniteMoeShared's
    ``input_linear`` with ``down="output_linear"``): ``down(act(g) * u)`` with ``g, u = gate_up(x).chunk(2,
    dim=-1)``, act and product fused as in :func:`glu_mlp_rule`, the product not kept when ``down`` is a plain
    nn.Linear (foak.ops.glu_linear). ``gate_up`` runs its own forward (a PEFT LoRA layer over it is one fused_lora
    call); when ``down`` is a LoRA layer that fused_lora patched, it runs as foak's fused LoRA GLU block
    (foak.patching.peft.lora_glu_mlp)."""

    def patch(module, model, state):
        activation = GLU_ACTIVATIONS[_hidden_act(model)]
        row = state.result
        blocks = row.__dict__.setdefault("block_counts", [0])

        def forward(self, x):
            gate_up_proj, down_proj = getattr(self, gate_up), getattr(self, down)
            x = cast_for_projections(x, (gate_up_proj,))
            lora_mlp = _lora_glu_mlp(self, (down,))
            if lora_mlp is not None:  # down a LoRA layer fused_lora patched: the fused LoRA GLU block
                out = lora_mlp(gate_up_proj, None, down_proj, x, activation)
                if out is not None:
                    if not torch.compiler.is_compiling():
                        blocks[0] += 1
                        row.note_runtime("lora_blocks", f"{blocks[0]} forwards as fused LoRA MLP blocks")
                    return out
            g, u = gate_up_proj(x).chunk(2, dim=-1)
            if _plain_linear(down_proj):
                return glu_linear(g, u, down_proj.weight, down_proj.bias, activation)
            return down_proj(glu(g, u, activation))

        return forward

    has_projections = lambda m, model: hasattr(m, gate_up) and hasattr(m, down)
    return Rule(f"{arch}.swiglu", "swiglu", Trigger(mlp_class, predicate=has_projections), patch, _glu_skip_reason)


def tiled_mlp_chunk_tokens(model: nn.Module) -> int:
    """The chunk size of the tiled_mlp rule on ``model``: ``foak.patch(..., tiled_mlp_chunk_tokens=N)``, else
    the hidden size (a [chunk, intermediate] tensor is then as large as one of the MLP's weight matrices)."""
    chunk = model.__dict__.get(TILED_MLP_CHUNK_ATTR)
    if chunk:
        return chunk
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(config, "hidden_size", 0) or 4096)


TILED_MLP_CHUNK_ATTR = "_foak_tiled_mlp_chunk_tokens"  # set on the model by foak.patch


def tiled_mlp_rule(arch: str, triggers: list[Trigger], experts: list[Trigger] = ()) -> Rule:
    """The gated MLP computed in sequence chunks in the forward and in the backward (foak.ops.tiled): no
    [tokens, intermediate] tensor lives whole. Wraps whatever runs the MLP (the swiglu rule's forward, the
    fused LoRA MLP block, HF's forward), so it composes with them; the forward runs without grad and only the
    MLP input is kept, the backward recomputes and differentiates one chunk at a time (one extra MLP forward
    per step; under non-reentrant checkpointing of a layer whose MLP saves last, only one extra chunk). Only inputs of at least two chunks are tiled; shorter ones, and torch.compile, run the MLP
    whole (the report row counts both). Opt-in (``tiled_mlp``): it pays at long context, where the [L, I]
    tensors of the MLP's recompute/backward dominate a layer's peak. ``experts``: the triggers of the routed
    experts (the MoE rule's), which are not tiled: the row says how many modules of the model that leaves out."""
    rule_id = f"{arch}.tiled_mlp"

    def matches(module, model):
        return any(isinstance(module, t.module_class) and (t.predicate is None or t.predicate(module, model))
                   for t in triggers)

    def patch(module, model, state):
        from foak.ops.tiled import tiled

        row, chunk, owner = state.result, tiled_mlp_chunk_tokens(model), weakref.ref(model)
        counts = row.__dict__.setdefault("tiled_counts", {"tiled": 0, "chunks": 0, "whole": 0, "traced": 0})

        def note_compiled(ctx):  # (run by dynamo while it traces: see at_trace_time)
            counts["traced"] += 1
            row.note_runtime("compiled", f"torch.compile traced {counts['traced']} MLP forward(s): compiled, the MLP "
                                         "runs whole (not tiled)")

        def forward(self, x, *args, **kwargs):
            if torch.compiler.is_compiling():
                at_trace_time(note_compiled)
                return call_next(self, rule_id, x, *args, **kwargs)
            tokens = x.numel() // max(x.shape[-1], 1)
            if args or kwargs or x.dim() < 2 or tokens < 2 * chunk:  # (extra arguments: not a per-token call)
                counts["whole"] += 1
                out = call_next(self, rule_id, x, *args, **kwargs)
            else:
                _check_not_fsdp(owner())
                params = [p for p in self.parameters() if p.requires_grad]
                out = tiled(lambda xc: call_next(self, rule_id, xc), x, params, chunk)
                # (counted once done: non-reentrant checkpointing's recompute stops early once the MLP input is
                # saved again, before the chunks run)
                counts["tiled"] += 1
                counts["chunks"] += -(-tokens // chunk)
            row.note_runtime("tiled", f"{counts['tiled']} forwards tiled ({counts['chunks']} chunks of <= {chunk} "
                                      f"tokens), {counts['whole']} of < {2 * chunk} tokens ran whole")
            return out

        return forward

    def describe(model):
        named = list(model.named_modules())
        counts: dict[str, int] = {}
        for name, module in named:
            if any(t.matches(name, module, model) for t in experts):
                counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
        if not counts:
            return None
        which = ", ".join(f"{n} {cls}" for cls, n in sorted(counts.items()))
        return f"routed experts not tiled: {which} module{'s' if sum(counts.values()) > 1 else ''}"

    module_class = triggers[0].module_class if len({t.module_class for t in triggers}) == 1 else nn.Module
    return Rule(rule_id, "tiled_mlp", Trigger(module_class, predicate=matches), patch, describe=describe)


def _check_not_fsdp(model: nn.Module | None) -> None:
    """Refuse under FSDP (1 or 2): it frees and re-gathers parameters around each wrapped module's forward and
    backward, which foak has not verified the tiled backward's recompute against (a recompute that read other
    tensors than the forward was given would raise in foak.ops.tiled; silently losing gradients is excluded)."""
    if model is None:
        return
    for m in model.modules():
        name = type(m).__name__
        if name == "FullyShardedDataParallel" or any(c.__name__ == "FSDPModule" for c in type(m).__mro__):
            raise RuntimeError(
                "foak tiled_mlp: the model is wrapped by FSDP, which tiled_mlp does not support yet (its backward "
                "recomputes the MLP chunk by chunk; not verified against FSDP's parameter gathering); turn "
                "tiled_mlp off under FSDP (DDP and single-device runs are supported)")


# ---- RoPE --------------------------------------------------------------------------------------------
# The modeling files look ``apply_rotary_pos_emb`` up in their module globals at call time. foak swaps
# that global for a dispatcher that runs foak's kernel only inside the forward of a patched attention
# module (a per-thread flag marks it) and the original everywhere else, so an unpatched model in the
# same process computes exactly what it did. The global is restored when the last model using it is
# restored or garbage-collected.


class _ThreadFlag(threading.local):
    """A per-thread on/off flag that torch.compile traces (ContextVar.get/set are graph breaks). ``on``
    exists from the start in every thread, so a compiled graph's guard on it does not change after the
    first call."""

    def __init__(self):
        self.on = False


_ROPE_ACTIVE = _ThreadFlag()


def _foak_apply_rotary_pos_emb(original, half_cos_sin: bool = False, interleaved: bool = False,
                               input_dtype: bool = False):
    """``half_cos_sin``: cos/sin hold one value per frequency (gpt-oss): the rotate_half layout repeats them
    ([B, S, D] per call). ``interleaved``: GLM's adjacent-pair layout (foak.ops.rope's ``interleaved``).
    ``input_dtype``: the modeling function casts its outputs back to q's / k's dtype (OLMo's), where HF's
    usual one returns the promoted dtype of q and cos."""

    def foak_rope(q, k, cos, sin, *args, **kwargs):
        if half_cos_sin:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        unsqueeze_dim = kwargs.pop("unsqueeze_dim", args[0] if args else 1)
        if kwargs or len(args) > 1:
            raise TypeError(f"foak rope: unexpected arguments {args[1:]}, {kwargs} for apply_rotary_pos_emb")
        if unsqueeze_dim == 2:  # q, k laid out [B, S, H, D]
            q_out, k_out = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, interleaved=interleaved)
            return q_out.transpose(1, 2), k_out.transpose(1, 2)
        if unsqueeze_dim != 1:
            raise ValueError(f"foak rope: unsqueeze_dim={unsqueeze_dim} is not supported (1 or 2)")
        return rope(q, k, cos, sin, interleaved=interleaved)

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not _ROPE_ACTIVE.on:
            return original(q, k, cos, sin, *args, **kwargs)
        q_out, k_out = foak_rope(q, k, cos, sin, *args, **kwargs)
        if input_dtype:
            return q_out.to(q.dtype), k_out.to(k.dtype)
        return q_out, k_out

    apply_rotary_pos_emb.__foak_original__ = original
    return apply_rotary_pos_emb


def _foak_apply_rotary_pos_emb_one(original):
    """The dispatcher of a modeling module whose ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)`` rotates one
    tensor per call (Gemma 4: q, then k where the layer has its own): foak's rope with a k of no heads."""

    def apply_rotary_pos_emb(x, cos, sin, *args, **kwargs):
        if not _ROPE_ACTIVE.on:
            return original(x, cos, sin, *args, **kwargs)
        unsqueeze_dim = kwargs.pop("unsqueeze_dim", args[0] if args else 1)
        if kwargs or len(args) > 1:
            raise TypeError(f"foak rope: unexpected arguments {args[1:]}, {kwargs} for apply_rotary_pos_emb")
        if unsqueeze_dim not in (1, 2):
            raise ValueError(f"foak rope: unsqueeze_dim={unsqueeze_dim} is not supported (1 or 2)")
        q = x.transpose(1, 2) if unsqueeze_dim == 2 else x  # [B, H, S, D]
        out = rope(q, q[:, :0], cos, sin)[0]
        return out.transpose(1, 2) if unsqueeze_dim == 2 else out

    apply_rotary_pos_emb.__foak_original__ = original
    return apply_rotary_pos_emb


def _install_rope(module_name: str, attr: str, half_cos_sin: bool = False, interleaved: bool = False,
                  input_dtype: bool = False, one_tensor: bool = False):
    module = sys.modules[module_name]
    original = getattr(module, attr)
    if one_tensor:
        replacement = _foak_apply_rotary_pos_emb_one(original)
    else:
        replacement = _foak_apply_rotary_pos_emb(original, half_cos_sin, interleaved, input_dtype)
    return globals_.replace_attribute(module, attr, replacement)


_QKV = ("q_proj", "k_proj", "v_proj")
_ROPE_OPTIONS: dict = {}  # (rope, module, function) -> the dispatcher options its rules use


def rope_rule(arch: str, attention_class: type, function_name: str = "apply_rotary_pos_emb",
              half_cos_sin: bool = False, skip_module=None, interleaved: bool = False,
              input_dtype: bool = False, one_tensor: bool = False) -> Rule:
    """``half_cos_sin``: the model's cos/sin hold one value per frequency ([..., D/2], gpt-oss), rotating
    ``[x1, x2]`` to ``[x1 cos - x2 sin, x2 cos + x1 sin]``: the same rotation as the rotate_half layout with
    cos/sin repeated, which the dispatcher builds ([B, S, D] per call) before foak's rope op.
    ``skip_module(attention) -> reason | None``: attention modules the rule leaves alone, with the reason in
    its row (e.g. SmolLM3's NoPE layers, which apply no rotary embedding). ``interleaved``: the modeling
    file's function rotates adjacent pairs (GLM's layout; foak.ops.rope's ``interleaved``). ``input_dtype``: it
    returns q and k in their own dtype (OLMo's ``.to(q_type)``), not the promoted dtype of q and cos.
    ``one_tensor``: the modeling module's function rotates one tensor per call, ``(x, cos, sin, unsqueeze_dim)``
    (Gemma 4), instead of the (q, k) pair."""
    module_name = attention_class.__module__

    def skip_reason(model):
        if not callable(getattr(sys.modules[module_name], function_name, None)):
            return f"{module_name} has no {function_name} to route through foak"
        return None

    rule_id = f"{arch}.rope"

    def patch(module, model, state):
        why_not = skip_module(module) if skip_module is not None else None
        if why_not:
            return Skip(why_not)
        options = (half_cos_sin, interleaved, input_dtype, one_tensor)
        key = ("rope", module_name, function_name)
        if _ROPE_OPTIONS.setdefault(key, options) != options:  # one modeling function, one way to route it
            raise RuntimeError(f"foak rope: {module_name}.{function_name} is routed with options {options} here "
                               f"and {_ROPE_OPTIONS[key]} by another rule")
        globals_.acquire_for(module, state, key,
                             functools.partial(_install_rope, module_name, function_name, *options))

        def forward(self, *args, **kwargs):
            # under autocast over fp32 weights, q/k/v share one cast of the input, unless they are quantized
            # (foak.patching.autocast)
            args, kwargs = cast_first_argument(args, kwargs, [getattr(self, p, None) for p in _QKV])
            previous = _ROPE_ACTIVE.on
            _ROPE_ACTIVE.on = True
            try:
                return call_next(self, rule_id, *args, **kwargs)
            finally:
                _ROPE_ACTIVE.on = previous

        return forward

    return Rule(rule_id, "rope", Trigger(attention_class), patch, skip_reason)


# ---- DeepSeek's interleaved RoPE (MLA attention: deepseek_v3, glm4_moe_lite) ------------------------


def _foak_apply_rotary_pos_emb_interleave(original):
    """DeepSeek's interleaved RoPE (``apply_rotary_pos_emb_interleave``: pairs ``(x0, x1), (x2, x3), ...`` each
    rotated by one frequency, returned de-interleaved as ``[rotated evens, rotated odds]``). That is exactly
    foak's rotate_half RoPE of the de-interleaved input ``[x0, x2, ..., x1, x3, ...]`` with ``cat(c, c)``, ``c``
    the first half of HF's cos (and sin), the half HF reads: one gather of q and k, then the op."""

    def apply_rotary_pos_emb_interleave(q, k, cos, sin, *args, **kwargs):
        if not _ROPE_ACTIVE.on:
            return original(q, k, cos, sin, *args, **kwargs)
        kwargs.pop("position_ids", None)  # unused by HF's function too
        unsqueeze_dim = kwargs.pop("unsqueeze_dim", args[1] if len(args) > 1 else 1)
        if kwargs or len(args) > 2:
            raise TypeError(f"foak rope: unexpected arguments {args[2:]}, {kwargs} for apply_rotary_pos_emb_interleave")
        half = cos.shape[-1] // 2
        cos, sin = torch.cat((cos[..., :half], cos[..., :half]), -1), torch.cat((sin[..., :half], sin[..., :half]), -1)
        q, k = (torch.cat((x[..., 0::2], x[..., 1::2]), -1) for x in (q, k))
        if unsqueeze_dim == 2:  # q, k laid out [B, S, H, D]
            q_out, k_out = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return q_out.transpose(1, 2), k_out.transpose(1, 2)
        if unsqueeze_dim != 1:
            raise ValueError(f"foak rope: unsqueeze_dim={unsqueeze_dim} is not supported (1 or 2)")
        return rope(q, k, cos, sin)

    apply_rotary_pos_emb_interleave.__foak_original__ = original
    return apply_rotary_pos_emb_interleave


def _install_rope_interleave(module_name: str, attr: str):
    module = sys.modules[module_name]
    return globals_.replace_attribute(module, attr, _foak_apply_rotary_pos_emb_interleave(getattr(module, attr)))


def interleaved_rope_rule(arch: str, attention_class: type,
                          function_name: str = "apply_rotary_pos_emb_interleave") -> Rule:
    """:func:`rope_rule` for an MLA attention that calls ``apply_rotary_pos_emb`` or, with
    ``config.rope_interleave``, DeepSeek's ``apply_rotary_pos_emb_interleave``: both go through foak's rope op."""
    base = rope_rule(arch, attention_class)
    module_name = attention_class.__module__

    def skip_reason(model):
        if not callable(getattr(sys.modules[module_name], function_name, None)):
            return f"{module_name} has no {function_name} to route through foak"
        return base.skip_reason(model)

    def patch(module, model, state):
        globals_.acquire_for(module, state, ("rope", module_name, function_name),
                             functools.partial(_install_rope_interleave, module_name, function_name))
        return base.patch(module, model, state)

    return Rule(base.id, base.switch, base.trigger, patch, skip_reason)


# ---- loss --------------------------------------------------------------------------------------------
# fused_linear_loss: while a patched causal LM computes a training loss (labels given, grad enabled), its
# lm_head computes the loss itself, inside its own forward: foak's linear_cross_entropy on (hidden,
# lm_head.weight) with the labels the causal LM's forward received (a per-thread _LossRequest), and
# returns it; the model's loss_function receives that tensor (divided by Granite's logits_scaling, or
# softcapped by Gemma's final_logit_softcapping, which the head has already applied to its logits) and
# returns it as the loss. So the [tokens, vocab] logits never exist, the output's ``logits`` is None, and
# the head's weight is read only where a wrapper that shards it (FSDP2, FSDP1, ZeRO-3) has gathered it:
# inside the head's call. Without labels, or without grad
# (evaluation wants logits), the model runs unchanged.
# The loss runs at the end of the forward, while every saved activation is alive, so its transient chunk
# adds to the step's peak. 512 MiB chunks (vs the op's 112 MiB default) measured +2.4% tokens/s on the
# Llama-1B-dims step and +3.5% on Llama-8B-dims for +0.3-0.4 GiB peak (benchmarks/results/train_step_h200_explore.json).
FUSED_LOSS_CHUNK_BYTES = 512 * 2**20
# An fp32 head weight under autocast accumulates its gradient in fp32, so each chunk re-reads and re-writes
# twice the bytes: 1 GiB chunks measured 58.1k vs 57.6k tokens/s (512 MiB) on the Llama-1B-dims autocast
# step for +0.5 GiB peak (2 GiB: 58.4k, +1.5 GiB; benchmarks/results/train_step_h200_llama1b_autocast_c*.json).
FUSED_LOSS_CHUNK_BYTES_FP32_ACCUMULATION = 1024 * 2**20


# Integrations that serve another library's fused LM head with foak's loss register here (imports point
# down: foak.integrations.trl appends itself when foak.api is imported). Each is called as
# hook(causal_lm, state, chunk_bytes_of_weight) for every causal LM the fused_linear_loss rule patches.
FUSED_HEAD_HOOKS: list = []
# ... and here to be told of each causal LM the fast_loss rule patches, as hook(causal_lm, state): a fused LM head
# of another library skips the model's loss_function, so fast_loss's cross_entropy does not run there; the hook
# writes those calls into the rule's row (the fast_loss row would otherwise claim a loss kernel that never ran)
LOGITS_LOSS_HOOKS: list = []


def fused_loss_chunk_bytes(weight: torch.Tensor) -> int:
    """The fused loss's logits-chunk budget for an LM head weight (see above)."""
    if weight.dtype == torch.float32 and torch.is_autocast_enabled(weight.device.type):
        return FUSED_LOSS_CHUNK_BYTES_FP32_ACCUMULATION
    return FUSED_LOSS_CHUNK_BYTES


def head_linears(head) -> list[nn.Linear]:
    """The nn.Linear modules that compute ``head``'s output: the head itself, or for a PEFT
    ``modules_to_save`` wrapper around it, the original and each trainable copy (the wrapper calls one)."""
    if isinstance(head, nn.Linear):
        return [head]
    original, copies = getattr(head, "original_module", None), getattr(head, "modules_to_save", None)
    if isinstance(original, nn.Linear) and isinstance(copies, nn.ModuleDict) and \
            all(isinstance(m, nn.Linear) for m in copies.values()):
        return [original, *copies.values()]
    return []


def _final_softcap(config) -> float | None:
    """The final-logit softcap a causal LM applies between lm_head and its loss (Gemma 2/3/4), or None."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "final_logit_softcapping", None) or getattr(text_config, "final_logit_softcapping", None)


def _causal_lm_skip_reason(model, serves_softcap: bool = False):
    if not serves_softcap and getattr(model.config, "final_logit_softcapping", None):
        return "final_logit_softcapping is applied between lm_head and the loss (not a linear map)"
    if not head_linears(getattr(model, "lm_head", None)):
        return "the model has no nn.Linear lm_head"
    return None


def _set_loss_function(causal_lm, state, loss_function):
    had = "_loss_function" in causal_lm.__dict__
    previous = causal_lm.__dict__.get("_loss_function")
    causal_lm.loss_function = loss_function

    def undo():
        if had:
            causal_lm._loss_function = previous
        else:
            causal_lm.__dict__.pop("_loss_function", None)

    state.on_restore(undo)


def _hf_loss_arguments(labels, shift_labels, ignore_index):
    """(target, shift) as transformers' ForCausalLMLoss would use them."""
    if shift_labels is not None:
        return shift_labels, False
    return labels, True


class _LossRequest(SharedAcrossCopies, threading.local):
    """Per thread: the loss arguments of the patched training forward in progress (None outside one), and
    the loss the LM head computed from them. A copy of the LM head (PEFT's ``modules_to_save``) listens to
    the same causal LM's requests."""

    def __init__(self):
        self.args = None
        self.loss = None


def _same(a, b) -> bool:
    """The same tensor object, or equal plain values."""
    return a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)


def _saved_constant(fn) -> float | None:
    """The constant a ``x * c`` / ``x / c`` autograd node saved (a Python number is saved as a 0-d tensor)."""
    other = getattr(fn, "_saved_other", None)
    return float(other) if isinstance(other, torch.Tensor) and other.dim() == 0 else None


def _softcapped(logits, loss, cap: float) -> bool:
    """``logits`` is ``tanh(loss / cap) * cap``: the three steps of a final-logit softcap (Gemma 2/3/4), this
    cap's."""
    steps = ("MulBackward0", "TanhBackward0", "DivBackward0")
    fn = getattr(logits, "grad_fn", None)
    for i, name in enumerate(steps):
        if fn is None or type(fn).__name__ != name:
            return False
        if name != "TanhBackward0" and _saved_constant(fn) != cap:
            return False
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if i == len(steps) - 1:
            return any(f is loss.grad_fn for f in inputs)
        if len(inputs) != 1:  # a tensor, not a constant, entered this step besides the chain
            return False
        fn = inputs[0]
    return False


def _follows_from(logits, loss, divisor, softcap=None) -> bool:
    """``logits`` (what the model handed its loss function) is the head's ``loss`` itself or, for an
    architecture that divides its logits (``divisor``), ``loss / divisor``, or, for one that softcaps them
    (``softcap``), ``tanh(loss / cap) * cap``: nothing else happened between the head and the loss that the
    fused head would have had to apply."""
    if softcap is not None:
        return _softcapped(logits, loss, softcap) if loss.requires_grad else logits is not loss
    if logits is loss or not loss.requires_grad:
        return logits is loss or divisor is not None
    fn = getattr(logits, "grad_fn", None)
    return (divisor is not None and fn is not None and type(fn).__name__ == "DivBackward0"
            and any(next_fn is loss.grad_fn for next_fn, _ in fn.next_functions))


def fused_linear_loss_rule(arch: str, causal_lm_class: type, logits_divisor: str | None = None,
                           final_softcap: bool = False) -> Rule:
    """The loss runs inside the LM head's own forward (its ``__call__``), with the labels the causal LM's
    forward received: whatever gathers the head's parameters around its forward (FSDP2's ``fully_shard``,
    with or without ``reshard_after_forward``; FSDP1; DeepSpeed ZeRO-3) has them gathered for the loss and
    releases them right after it, and the backward passes through the head's own hooks. The head returns
    the loss; the model's loss function returns that same tensor. ``logits_divisor``: the config attribute by
    which the architecture divides its logits before the loss (Granite's ``logits_scaling``), applied inside
    the loss; ``final_softcap``: the architecture applies ``config.final_logit_softcapping`` (its text
    config's) as ``tanh(logits / cap) * cap`` before the loss (Gemma 2/3/4), which the fused loss applies
    inside (foak.ops.linear_cross_entropy's ``softcap``); anything else between head and loss is an error."""

    rule_id = f"{arch}.fused_linear_loss"

    def patch(model_module, model, state):
        # model_module is the causal LM itself (model may be a wrapper around it, e.g. a PeftModel)
        lm_head = model_module.lm_head
        request = _LossRequest()
        divisor = float(getattr(model_module.config, logits_divisor)) if logits_divisor else None
        softcap = _final_softcap(model_module.config) if final_softcap else None
        softcap = float(softcap) if softcap else None

        def lm_head_forward(self, hidden_states):
            if request.args is None:
                return call_next(self, rule_id, hidden_states)
            if request.loss is not None:
                raise RuntimeError("foak fused_linear_loss: lm_head was called twice in one training forward")
            labels, shift_labels, ignore_index, num_items_in_batch = request.args
            target, shift = _hf_loss_arguments(labels, shift_labels, ignore_index)
            weight = self.weight  # read now: inside the head's forward, gathered if it is sharded
            hidden = hidden_states.to(weight.dtype)  # the head's own dtype, as nn.Linear requires
            if not shift:
                hidden = hidden.reshape(-1, hidden.shape[-1])
                target = target.reshape(-1)
            request.loss = linear_cross_entropy(
                hidden, weight, target.to(hidden.device), self.bias, shift=shift, ignore_index=ignore_index,
                num_items_in_batch=num_items_in_batch, logits_scaling=divisor or 1.0, softcap=softcap,
                chunk_bytes=fused_loss_chunk_bytes(weight))
            return request.loss

        for linear in head_linears(lm_head):  # (PEFT's modules_to_save: the original and its copies)
            state.set_forward(linear, lm_head_forward)
        for hook in FUSED_HEAD_HOOKS:  # e.g. TRL's own fused head, which skips lm_head and the loss
            hook(model_module, state, fused_loss_chunk_bytes)

        def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                          shift_labels=None, **kwargs):
            if request.args is None:
                raise RuntimeError("foak fused_linear_loss: loss_function called outside a patched forward")
            loss = request.loss
            if loss is None:
                raise RuntimeError("foak fused_linear_loss: the model computed its loss without calling lm_head")
            given = (labels, shift_labels, ignore_index, num_items_in_batch)
            if not all(_same(a, b) for a, b in zip(given, request.args)):
                raise RuntimeError(
                    "foak fused_linear_loss: the model called its loss with other labels / shift_labels / "
                    "ignore_index / num_items_in_batch than its forward received, which lm_head used; disable "
                    "fused_linear_loss for this model")
            if not torch.compiler.is_compiling() and not _follows_from(logits, loss, divisor, softcap):
                raise RuntimeError(
                    f"foak fused_linear_loss: {type(model_module).__name__} changed lm_head's output before its "
                    "loss in a way foak's fused head does not apply (a transformers version foak does not "
                    "know?); disable fused_linear_loss (use fast_loss)")
            return loss

        original_loss = model_module.loss_function
        _set_loss_function(model_module, state, loss_function)
        result, unlabelled = state.result, [0]

        def forward(self, *args, **kwargs):
            if kwargs.get("labels") is None or not torch.is_grad_enabled():
                if torch.is_grad_enabled() and self.training and not torch.compiler.is_compiling():
                    # a training forward the rule cannot act on: the caller computes the loss from the logits
                    unlabelled[0] += 1
                    result.note_runtime("no_labels", (
                        f"{unlabelled[0]} training forward{'s' if unlabelled[0] > 1 else ''} without labels "
                        "computed logits: the caller's loss ran, not foak's (e.g. a compute_loss_func or "
                        "label smoothing)"))
                self.loss_function = original_loss
                try:
                    return call_next(self, rule_id, *args, **kwargs)
                finally:
                    self.loss_function = loss_function
            previous = request.args, request.loss
            request.args = (kwargs["labels"], kwargs.get("shift_labels"), kwargs.get("ignore_index", -100),
                            kwargs.get("num_items_in_batch"))
            request.loss = None
            try:
                out = call_next(self, rule_id, *args, **kwargs)
            finally:
                request.args, request.loss = previous
            if isinstance(out, tuple):  # return_dict=False: (loss, logits, ...)
                return (out[0], None, *out[2:])
            out["logits"] = None  # they were never computed
            return out

        return forward

    return Rule(rule_id, "fused_linear_loss", Trigger(causal_lm_class), patch,
                functools.partial(_causal_lm_skip_reason, serves_softcap=final_softcap))


def loss_rule(arch: str, causal_lm_class: type) -> Rule:
    """fast_loss: the model computes its logits as usual; foak's cross-entropy kernel computes the loss."""

    rule_id = f"{arch}.loss"

    def patch(model_module, model, state):
        row, ran = state.result, [0]

        def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                          shift_labels=None, **kwargs):
            target, shift = _hf_loss_arguments(labels, shift_labels, ignore_index)
            if shift:
                target = nn.functional.pad(target, (0, 1), value=ignore_index)[..., 1:]
            if not torch.compiler.is_compiling():  # (what ran, in the row: a caller may compute its own loss)
                ran[0] += 1
                row.note_runtime("calls", f"foak cross_entropy ran {ran[0]} call{'s' if ran[0] != 1 else ''}")
            return cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1).to(logits.device),
                                 ignore_index=ignore_index, num_items_in_batch=num_items_in_batch)

        _set_loss_function(model_module, state, loss_function)
        for hook in LOGITS_LOSS_HOOKS:  # e.g. TRL's fused LM head, which never calls loss_function
            hook(model_module, state)

        def forward(self, *args, **kwargs):  # the forward itself is unchanged
            return call_next(self, rule_id, *args, **kwargs)

        return forward

    return Rule(rule_id, "loss", Trigger(causal_lm_class), patch)


def causal_lm_rules(arch: str, causal_lm_class: type, logits_divisor: str | None = None,
                    final_softcap: bool = False) -> list[Rule]:
    return [loss_rule(arch, causal_lm_class),
            fused_linear_loss_rule(arch, causal_lm_class, logits_divisor, final_softcap)]


def decoder_rules(arch: str, modeling, prefix: str, gated_mlp: bool = True, logits_divisor: str | None = None,
                  norm_mode: str = "llama", rope_skip=None, rope_interleaved: bool = False,
                  rope_input_dtype: bool = False) -> list[Rule]:
    """The rules of a Llama-like decoder whose modeling module defines <prefix>RMSNorm, <prefix>Model,
    <prefix>Attention, <prefix>MLP (when gated_mlp) and <prefix>ForCausalLM. ``logits_divisor``: the config
    attribute the causal LM divides its logits by before the loss (Granite's ``logits_scaling``).
    ``norm_mode``: foak.ops.rms_norm's mode for <prefix>RMSNorm; ``rope_skip``, ``rope_interleaved``,
    ``rope_input_dtype``: rope_rule's skip_module, interleaved and input_dtype."""
    rules = [rms_norm_rule(arch, getattr(modeling, f"{prefix}RMSNorm"), norm_mode),
             rms_norm_recompute_rule(arch, getattr(modeling, f"{prefix}Model")),
             rope_rule(arch, getattr(modeling, f"{prefix}Attention"), skip_module=rope_skip,
                       interleaved=rope_interleaved, input_dtype=rope_input_dtype)]
    if gated_mlp:
        rules.append(glu_mlp_rule(arch, getattr(modeling, f"{prefix}MLP")))
    from foak.patching.packed_attention import packed_attention_rule  # its stack wrapper goes around the others

    return [*rules, *causal_lm_rules(arch, getattr(modeling, f"{prefix}ForCausalLM"), logits_divisor),
            packed_attention_rule(arch, getattr(modeling, f"{prefix}Model"))]
