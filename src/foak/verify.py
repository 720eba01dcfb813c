"""``foak verify``: patched vs unpatched copies of a model, one forward and backward on a fixed batch, rule by
rule and with the rules together, comparing the loss and every parameter gradient one parameter at a time.

What runs (:func:`verify_model`):

- every rule switch foak has for the model's architecture, each alone: the full fine-tuning rules on a padded
  batch (:func:`fixed_batch`); ``packed_attention`` on a packed batch (:func:`packed_batch`: several sequences
  in one row, position_ids restarting at 0, no attention_mask, as TRL's padding-free collation and
  transformers' DataCollatorWithFlattening produce); ``lora`` (fused_lora) on a PEFT LoRA copy of the model
  (:func:`lora_model`, non-zero adapters over the attention and MLP projections) unless the model already
  is one;
- the rules together as ``foak.patch(model)`` would patch them: the full fine-tuning ones on the padded
  batch, and those plus ``lora`` on the LoRA copy with the packed batch;
- ``offload_activations`` alone on the padded batch, with gradient checkpointing and the decoder layers in
  training mode (:func:`_checkpointed_training`): at least one layer's input must have been offloaded;
- the rules whose report rows count their calls (``lora``, ``moe``, ``packed_attention``) must have run
  their fused path at least once in a row that exercises them, or the row fails;
- a rule that patched no module of the model (e.g. ``packed_attention`` under flash attention) or that
  could not be exercised (``lora`` without peft) is reported as skipped, with the reason, never as a pass.

The reference for the packed batch is the unpatched model run on that same batch with ``use_cache=False``:
transformers 5's sdpa and eager paths then find the packed sequences (``find_packed_sequence_indices``) and
attend per sequence through a block-causal mask (tests/test_verify.py checks it against each sequence run
alone). With a KV cache (the config's ``use_cache=True``) they do not look for packing and the sequences
attend to each other, while foak's packed path keeps them apart (foak.patching.packed_attention): no
reference there, so the batch passes ``use_cache=False``. gpt-oss builds its masks without the position ids
(transformers then does not look for packing): its reference run gets them passed to transformers' mask
builders (:func:`_masks_see_packing`).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from foak.config import SWITCH_TO_RULE, AccelerationConfig
from foak.testing import relative_error

SWITCH_KEYS = {rule: key for key, rule in SWITCH_TO_RULE.items()}  # rule switch -> config key
FP32_TOLERANCE = 1e-5  # fp32: loss and each gradient vs the unpatched model's
# bf16 / fp16: the patched and the unpatched low-precision model are both compared with an fp32 copy of the
# unpatched one. Two low-precision runs differ from each other by rounding alone, so the patched model's error
# may exceed the unpatched model's own, parameter by parameter (never all gradients pooled into one vector: a
# small group such as the norm weights vanishes in it; zeroing every norm-weight gradient of the tiny Llama
# moved the pooled error by ~5e-4): bound = max(LOW_PRECISION_FACTOR x HF's own error of that gradient,
# GRAD_FLOOR_UNITS unit roundoffs), the loss likewise with LOSS_FLOOR_UNITS.
# Measured in bf16 on the tiny model of every architecture (each rule alone and all together, full and LoRA,
# padded and packed; 1,900 gradients): foak's error / HF's error per parameter was at most 1.6 with
# round-to-nearest bf16 casts (the GPU's; the tests' interpreter compatibility layer), except a MoE router
# (qwen3_moe, 3.2: a bf16 difference upstream flips a token's top-k choice, which moves the router's gradient
# by a step); with the stock CPU interpreter, which truncates fp32 -> bf16 casts inside the kernels, it was at
# most 3.0 (router 3.8). HF's own errors were at most 0.024, foak's 0.049 (that router). FACTOR 8 leaves 2x
# over the worst ratio; a zeroed or missing gradient (error 1.0) still fails for any parameter whose HF error
# is below 1/8, 5x above the largest measured. The gradient floor (5 unit roundoffs: 0.02 in bf16) only
# matters for a gradient HF computes almost exactly (measured: foak exact there too). fp16 measured ratios
# <= 1.3. The loss floor (a quarter unit roundoff, 1e-3 in bf16) is 10x the largest loss error measured (the
# loss is an fp32 mean, far more precise than one bf16 value). fp32 verify (1e-5) stays the exact check.
LOW_PRECISION_FACTOR = 8.0
# never above this: a zeroed (or missing) gradient has error 1 and must fail even where the unpatched
# low-precision model's own error is large (on the H200, a tiny bf16 Mixtral's norm weights: HF's own error
# 0.21, so 8x of it would be 1.7). The largest foak error measured there was 0.21
# (benchmarks/results/silent_h200/verify_mixtral_bf16.log).
MAX_LOW_PRECISION_BOUND = 0.5
GRAD_FLOOR_UNITS = 5.0
LOSS_FLOOR_UNITS = 0.25
LOW_PRECISION = (torch.bfloat16, torch.float16)
# fp32: a gradient that misses FP32_TOLERANCE vs the unpatched fp32 model is compared with the unpatched model
# run in fp64 instead. Some gradients amplify fp32 rounding by 100-1000x (Qwen3.5's gated delta net: A_log /
# dt_bias, sums that nearly cancel; Gemma 4's attention scale of 1), so two correct fp32 runs differ by more
# than 1e-5, by an amount the rounding itself decides. The bound is the unpatched fp32 model's own
# sensitivity: FP64_ARBITER_FACTOR x the largest of its error vs fp64, the errors vs fp64 of ROUNDING_SAMPLES
# copies of it whose every weight moved one fp32 rounding step (runs that differ from it in rounding alone),
# and FP32_TOLERANCE; x3 because foak's ops round differently in several places per layer, not once per
# weight. A wrong gradient (error ~1) still fails wherever that sensitivity is below 0.3. Measured (tiny
# models, CPU): Gemma 4 LoRA, foak 5.8e-5 vs fp64 where transformers' fp32 is 9.0e-5; Qwen3.5-MoE's
# dt_bias, foak 1.0e-4, the rounding-moved copies up to 3.7e-5.
FP64_ARBITER_FACTOR = 3.0


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2  # bf16 2^-8, fp16 2^-11


# the rules whose report rows count the calls their fused path ran and the ones that took the previous path
COUNTED = ("lora", "moe", "packed_attention")
# sequence lengths of each row of the packed batch: a 1-token sequence, a row holding one sequence only
PACKED_LENGTHS = ((5, 1, 4, 3), (6, 7))


@dataclass
class VerifyRow:
    """One check: ``switches`` patched on a copy of ``model_kind`` ("model" or "LoRA"), run on ``batch_kind``
    ("padded" or "packed"). ``grad_error`` / ``grad_bound`` are those of ``worst_param``, the parameter
    closest to (or furthest over) its bound. ``problems`` say why it failed beyond the numbers (a fused
    path that never ran)."""

    name: str
    switches: list[str]
    model_kind: str
    batch_kind: str
    modules: int
    calls: dict[str, tuple[int, dict[str, int]]]  # counted switch -> (fused calls, {reason: other calls})
    loss_error: float
    loss_bound: float
    grad_error: float
    grad_bound: float
    worst_param: str
    problems: list[str] = field(default_factory=list)
    notes: str = ""  # the patch report's patch-time notes of these rules (modules they left alone, and why)

    @property
    def calls_text(self) -> str:
        parts = []
        for switch, (fused, other) in self.calls.items():
            text = f"{switch} {fused}/{fused + sum(other.values())}"
            if other:
                text += " (" + ", ".join(f"{why}: {n}" for why, n in sorted(other.items())) + ")"
            parts.append(text)
        return "; ".join(parts) or "-"

    @property
    def passed(self) -> bool:
        return (not self.problems and self.loss_error <= self.loss_bound and self.grad_error <= self.grad_bound)


@dataclass
class VerifyReport:
    """The rows checked and, per rule switch not checked, why (``skipped``)."""

    dtype: torch.dtype
    rows: list[VerifyRow]
    skipped: dict[str, str]
    unavailable: list[str]  # switches foak has no rule for on this architecture

    @property
    def failed(self) -> list[VerifyRow]:
        return [r for r in self.rows if not r.passed]

    @property
    def passed(self) -> bool:
        return bool(self.rows) and not self.failed


def fixed_batch(vocab_size: int, batch: int = 2, seq: int = 13, seed: int = 0, device="cpu"):
    """Random token ids with left padding on the second row (labels -100 there)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, : seq // 4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def packed_batch(vocab_size: int, lengths=PACKED_LENGTHS, seed: int = 1, device="cpu"):
    """Rows of several sequences each: position_ids restart at 0 at every sequence, no attention_mask, the
    first label of each sequence -100 (no prediction across a boundary), no KV cache."""
    width = sum(lengths[0])
    if any(sum(row) != width for row in lengths):
        raise ValueError(f"packed_batch: every row must hold {width} tokens, got {[sum(r) for r in lengths]}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (len(lengths), width), generator=gen)
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    labels = ids.masked_fill(pos == 0, -100)
    return {"input_ids": ids.to(device), "position_ids": pos.to(device), "labels": labels.to(device),
            "use_cache": False}


def lora_model(model: nn.Module, rank: int = 4, seed: int = 0) -> nn.Module:
    """A PEFT LoRA model over a copy of the unpatched ``model``: rank-``rank`` adapters on every linear
    projection but the LM head (attention and MLP; GPTQ layers through foak's GPTQLoraLinear; MoE experts,
    which are not nn.Linear, get none unless PEFT adds them itself: for DeepSeek-V3 / GLM-4-MoE it also wraps
    the experts' 3-d weights and the router's weight in ParamWrappers), dropout 0,
    lora_A and lora_B drawn from a seeded generator (B non-zero, so the adapters change the output)."""
    import peft

    from foak.quant.gptq import GPTQLinear

    base = copy.deepcopy(model)
    head = base.get_output_embeddings()
    # not a transformers class that subclasses nn.Linear with a forward of its own (Llama4Router returns a
    # tuple): PEFT's LoRA layer cannot wrap it
    def own_forward(m):
        return type(m).__module__.startswith("transformers.models.") and type(m).forward is not nn.Linear.forward

    targets = [n for n, m in base.named_modules()
               if isinstance(m, (nn.Linear, GPTQLinear)) and m is not head and not own_forward(m)]
    if not targets:
        raise ValueError("the model has no linear projection to put LoRA adapters on")
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets)
    if any(isinstance(m, GPTQLinear) for m in base.modules()):
        from foak.quant.gptq_peft import register_gptq_lora

        register_gptq_lora(config)
    lora = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if ".lora_A." in name:  # [r, in]: kaiming-uniform's range, as PEFT draws it
                bound = 1 / math.sqrt(p.shape[1])
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
            elif ".lora_B." in name:  # PEFT starts B at zero (the adapter a no-op): not here
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return lora


def _is_peft(model) -> bool:
    from foak.patching.peft import is_peft_model

    return is_peft_model(model)


ROUNDING_SAMPLES = 2  # rounding-moved copies of the unpatched model the fp64 arbiter measures


def _rounding_moved(model, seed: int):
    """A copy of ``model`` with every floating-point weight moved one fp32 rounding step up or down."""
    moved = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moved.parameters():
            if p.is_floating_point():
                sign = torch.randint(0, 2, p.shape, generator=gen).to(p.device, p.dtype) * 2 - 1
                p.mul_(1 + sign * 2.0**-23)
    return moved


@contextlib.contextmanager
def _masks_see_packing(model, batch):
    """For the unpatched reference on a packed batch: transformers' mask builders (``create_causal_mask``,
    ``create_sliding_window_causal_mask``) called by the model's modeling modules get the batch's position_ids
    where the model passes none (gpt-oss builds its masks without them, so its sequences would attend to each
    other; transformers' packing detection needs them). A model that passes them is unchanged."""
    position_ids = batch.get("position_ids")
    if position_ids is None or batch.get("attention_mask") is not None:
        yield
        return
    from transformers import masking_utils

    replaced = []
    for module in {sys.modules.get(type(m).__module__) for m in model.modules()} - {None}:
        for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
            original = getattr(module, name, None)
            if original is None or original is not getattr(masking_utils, name, None):
                continue

            def with_ids(*args, _original=original, **kwargs):
                if kwargs.get("position_ids") is None:
                    kwargs["position_ids"] = position_ids
                return _original(*args, **kwargs)

            setattr(module, name, with_ids)
            replaced.append((module, name, original))
    try:
        yield
    finally:
        for module, name, original in replaced:
            setattr(module, name, original)


def _reference_run(model, batch):
    """:func:`_run` of the unpatched model (see :func:`_masks_see_packing`)."""
    with _masks_see_packing(model, batch):
        return _run(model, batch)


def _run(model, batch):
    """(loss, {name: gradient}) after one forward and backward."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _call_counts(report, switch: str) -> tuple[int, dict[str, int]]:
    """(calls the rule's fused path ran, {reason: calls that took the previous path}) of ``switch``'s rows."""
    from foak.patching.moe import moe_counts
    from foak.patching.packed_attention import packed_attention_counts, sink_attention_counts, window_attention_counts
    from foak.patching.peft import fused_lora_counts

    fused, other = 0, {}
    for r in report.results:
        if r.switch != switch:
            continue
        if switch == "lora":
            n, o = fused_lora_counts(report, r.rule_id)
        elif switch == "moe":
            n, o = moe_counts(report, r.rule_id)
        else:
            ran, o = packed_attention_counts(report, r.rule_id)
            n = sum(ran.values()) + sum(window_attention_counts(report, r.rule_id).values())  # sliding-window layers
            n += sum(sink_attention_counts(report, r.rule_id)[1].values())  # full layers of unpacked batches (sinks)
        fused += n
        for why, k in o.items():
            other[why] = other.get(why, 0) + k
    return fused, other


def _compare(got, ref, hf, dtype, exact=None) -> tuple[float, float, float, float, str, int]:
    """(loss error, loss bound, gradient error, its bound, parameter, gradients arbitrated in fp64) of ``got``
    against ``ref``; ``hf`` is the unpatched low-precision run (None in fp32), which sets the bounds; ``exact()``
    (fp32 only) the unpatched model's fp64 run, for the gradients that miss FP32_TOLERANCE (FP64_ARBITER_FACTOR).
    The parameter reported is the one with the largest error / bound ratio. A gradient ``got`` lacks counts
    as zero (error 1)."""
    (loss, grads), (ref_loss, ref_grads) = got, ref
    extra = sorted(grads.keys() - ref_grads.keys())
    if extra:
        raise ValueError(f"foak verify: the patched model has gradients the unpatched one lacks: {extra[:3]}")

    def bound(err_hf: float | None, floor_units: float) -> float:
        if err_hf is None:
            return FP32_TOLERANCE
        return min(max(LOW_PRECISION_FACTOR * err_hf, floor_units * unit_roundoff(dtype)), MAX_LOW_PRECISION_BOUND)

    loss_error = relative_error(loss, ref_loss)
    loss_bound = bound(None if hf is None else relative_error(hf[0], ref_loss), LOSS_FLOOR_UNITS)
    worst, arbitrated = None, 0
    for name, g_ref in ref_grads.items():
        g = grads.get(name)
        err = 1.0 if g is None else relative_error(g, g_ref)
        b = bound(None if hf is None else relative_error(hf[1][name], g_ref), GRAD_FLOOR_UNITS)
        if hf is None and exact is not None and g is not None and not err <= b and exact() is not None:
            g64 = exact()[1].get(name)
            if g64 is not None:  # the error vs fp64, against the unpatched fp32 model's own sensitivity
                g64 = g64.to(g.dtype)
                own = max([relative_error(g_ref, g64)] + [relative_error(moved[name], g64) for moved in exact()[2]
                                                          if name in moved])
                err, b = relative_error(g, g64), FP64_ARBITER_FACTOR * max(own, b)
                arbitrated += 1
        ratio = err / b if err == err else math.inf
        if worst is None or ratio > worst[0]:
            worst = (ratio, err, b, name)
    if worst is None:
        raise ValueError("foak verify: no parameter received a gradient")
    return loss_error, loss_bound, worst[1], worst[2], worst[3], arbitrated


def switches_to_check(model, switches: list[str] | None = None) -> tuple[list[str], dict[str, str], list[str]]:
    """(the rule switches verify_model will try, {switch: why it is not checked}, the config keys foak has no
    rule for on this architecture). ``switches``: rule switches (``moe``) or config keys (``fast_moe``); None:
    every switch the architecture has."""
    from foak.api import rules_of
    from foak.models import model_type_of

    model_type = model_type_of(model)
    # (offload_activations is not per architecture: every model with a decoder stack of checkpointing layers)
    available = sorted({r.switch for r in rules_of(model, offload=True)})
    if switches is None:
        switches = list(available)
    switches = [SWITCH_TO_RULE.get(s, s) for s in switches]  # config keys (fast_moe) name their rule (moe)
    settings = sorted(set(switches) & (set(AccelerationConfig.model_fields) - set(SWITCH_TO_RULE) - {"mode"}))
    if settings:  # (cudnn_attention: CUDA's cuDNN SDPA, which verify's batches never ask for)
        raise ValueError(f"foak verify: {settings} {'is a setting' if len(settings) == 1 else 'are settings'} of a "
                         f"rule, not a rule switch: foak verify does not check {'it' if len(settings) == 1 else 'them'}"
                         f" (it checks the rules {available})")
    unknown = sorted(set(switches) - set(available))
    if unknown:
        raise ValueError(f"foak verify: {unknown} not available for {model_type} (available: {available})")
    if not switches:  # nothing compared is never a pass
        raise ValueError(f"foak verify: no rule to check (available for this model: {available or 'none'})")
    skipped = {s: "not requested (--rules)" for s in available if s not in switches}
    unavailable = [key for rule, key in SWITCH_KEYS.items() if rule not in available]
    switches = [s for s in available if s in switches]
    if "lora" in switches and not _is_peft(model):
        try:
            import peft  # noqa: F401
        except ImportError:
            skipped["lora"] = "peft is not installed, so no LoRA model could be built (pip install peft)"
            switches.remove("lora")
    return switches, skipped, unavailable


def verify_model(model, switches: list[str] | None = None) -> VerifyReport:
    """Check foak's rules on ``model`` (unpatched; left unchanged): see the module docstring. ``switches``:
    the rule switches to check (default: every one foak has for the architecture, ``lora`` included).

    fp32: the loss and every parameter's gradient of the patched copy within 1e-5 (relative) of the
    unpatched copy's. bf16 / fp16: each within max(LOW_PRECISION_FACTOR x the unpatched low-precision
    model's own error, a floor) of an fp32 copy's (see LOW_PRECISION_FACTOR)."""
    from foak.api import default_config, is_patched, patch

    if is_patched(model):
        raise ValueError("foak verify: the model is already patched; pass the unpatched model (foak.restore(model))")
    peft_input = _is_peft(model)
    switches, skipped, unavailable = switches_to_check(model, switches)

    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    low = dtype != torch.float32
    if low and dtype not in LOW_PRECISION:
        raise ValueError(f"foak verify: weights in {dtype}; foak verify takes float32, bfloat16 or float16")
    base = copy.deepcopy(model).eval()  # dropout off: both sides see the same function
    base_kind = "LoRA" if peft_input else "model"
    vocab_size = model.config.get_text_config().vocab_size  # a multimodal model's: its text model's
    batches = {"padded": fixed_batch(vocab_size, device=device), "packed": packed_batch(vocab_size, device=device)}
    cache: dict = {}  # one reference at a time (the rows that share one are consecutive): memory of a real model

    def reference(unpatched_model, model_kind, batch_kind):
        """(the run it is compared with, the unpatched low-precision run or None)."""
        key = (model_kind, batch_kind)
        if cache.get("key") != key:
            cache.clear()
            unpatched = _reference_run(unpatched_model, batches[batch_kind])
            if low:
                fp32 = copy.deepcopy(unpatched_model).float()
                cache["value"] = (_reference_run(fp32, batches[batch_kind]), unpatched)
                del fp32
            else:
                cache["value"] = (unpatched, None)
            cache["key"] = key
        return cache["value"]

    def exact(unpatched_model, batch_kind):
        """The unpatched model's fp64 run (fp32 verify only; computed when a gradient first needs it)."""
        key = ("fp64", id(unpatched_model), batch_kind)
        if cache.get("exact_key") != key:
            cache.pop("exact", None)
            fp64 = copy.deepcopy(unpatched_model).double()
            for m in fp64.modules():  # transformers' grouped_mm experts take no fp64: its eager loop computes them
                config = getattr(m, "config", None)
                if getattr(config, "_experts_implementation", None) not in (None, "eager"):
                    config._experts_implementation = "eager"
            try:
                cache["exact"] = (*_reference_run(fp64, batches[batch_kind]),
                                  [_reference_run(_rounding_moved(unpatched_model, seed), batches[batch_kind])[1]
                                   for seed in range(ROUNDING_SAMPLES)])
            except (RuntimeError, TypeError, ValueError, NotImplementedError):  # a model that cannot run in fp64
                cache["exact"] = None
            cache["exact_key"] = key
            del fp64
        return cache["exact"]

    rows: list[VerifyRow] = []

    def check(combo, unpatched_model, model_kind, batch_kind):
        name = combo[0] if len(combo) == 1 else "all: " + ", ".join(combo)
        row = _check(combo, name, unpatched_model, model_kind, batch_kind, batches, reference, dtype, patch,
                     skipped, None if low else (lambda: exact(unpatched_model, batch_kind)))
        if row is not None:
            rows.append(row)
        return row

    # each rule alone: the full fine-tuning ones on the padded batch, packed attention on the packed one
    for s in switches:
        if s not in ("lora", "packed_attention"):
            check([s], base, base_kind, "padded")
    if "packed_attention" in switches:
        check(["packed_attention"], base, base_kind, "packed")
    # together, as foak.patch(model) picks them (one loss); offload_activations only alone (it needs training mode)
    together = [s for s in switches if s not in ("lora", "offload_activations") and s not in skipped]
    if "loss" in together and "fused_linear_loss" in together:  # they exclude each other: foak.patch's pick
        default = default_config(base).enabled_rules()
        together.remove("loss" if "fused_linear_loss" in default else "fused_linear_loss")
    if len(together) > 1:
        check(together, base, base_kind, "padded")
    lora_together = None
    if "lora" in switches:  # fused_lora alone, then with the others (on the packed batch if packed attention is)
        try:
            lora = base if peft_input else lora_model(base).eval()
        except ValueError as e:  # e.g. no linear projection PEFT can wrap
            skipped["lora"] = f"no LoRA model could be built: {e}"
        else:
            if check(["lora"], lora, "LoRA", "padded") is not None and together:
                batch_kind = "packed" if "packed_attention" in together else "padded"
                lora_together = check(["lora", *together], lora, "LoRA", batch_kind)
            del lora
    if lora_together is None and len(together) > 1 and "packed_attention" in together:
        check(together, base, base_kind, "packed")
    del base, cache
    gc.collect()
    if not rows:
        raise ValueError("foak verify: nothing could be checked: " + "; ".join(
            f"{s} ({SWITCH_KEYS[s]}): {why}" for s, why in skipped.items() if s in switches))
    return VerifyReport(dtype, rows, skipped, unavailable)


VERIFY_TILE_TOKENS = 4  # tiled_mlp's chunk in verify: small, so that its short batches are tiled (partial chunks)


def _check(combo, name, model, model_kind, batch_kind, batches, reference, dtype, patch, skipped, exact=None):
    """One row: ``combo`` patched on a copy of the unpatched ``model``, against the references."""
    patched = copy.deepcopy(model)
    options = {"tiled_mlp_chunk_tokens": VERIFY_TILE_TOKENS} if "tiled_mlp" in combo else {}
    report = patch(patched, **{SWITCH_KEYS[s]: True for s in combo}, **options)
    modules = {s: sum(r.modules for r in report.results if r.switch == s) for s in combo}
    idle = [s for s in combo if not modules[s]]
    if idle and len(combo) == 1:  # patched nothing: skipped, with the report's reason
        notes = "; ".join(r.notes for r in report.results if r.switch == combo[0] and r.notes)
        skipped[combo[0]] = f"patched no module of the model ({notes or 'no reason given'})"
        return None
    batch = batches[batch_kind]
    if "offload_activations" in combo:  # it offloads the checkpointed layers' inputs of a training forward
        try:
            _checkpointed_training(patched)
        except ValueError as e:  # transformers: the model does not support gradient checkpointing
            skipped["offload_activations"] = f"gradient checkpointing could not be enabled ({e})"
            return None
        batch = {**batch, "use_cache": False}
    ref, hf = reference(model, model_kind, batch_kind)
    got = _run(patched, batch)
    loss_error, loss_bound, grad_error, grad_bound, worst, arbitrated = _compare(got, ref, hf, dtype, exact)
    # a rule that patched modules alone but none together with the others
    problems = [f"{s}: patched no module together with the other rules" for s in idle]
    calls = {}
    for s in combo:
        if s not in COUNTED:
            continue
        fused, other = calls[s] = _call_counts(report, s)
        if s == "packed_attention" and batch_kind != "packed":
            continue  # a padded batch: the previous implementation, exactly (sliding-window layers: foak's)
        if fused == 0:
            why = ", ".join(f"{w} ({n})" for w, n in sorted(other.items())) or "it was never called"
            problems.append(f"{s}: the fused path never ran ({why})")
    if "offload_activations" in combo:  # the layers whose inputs went to CPU memory in the forward
        offloaded, kept = _offload_counts(patched)
        calls["offload_activations"] = (offloaded, kept)
        if offloaded == 0:
            why = ", ".join(f"{w} ({n})" for w, n in sorted(kept.items())) or "no checkpointed layer ran"
            problems.append(f"offload_activations: no layer's input was offloaded ({why})")
    notes = "; ".join(f"{r.rule_id}: {r.note}" for r in report.results if r.switch in combo and r.note)
    if "offload_activations" in combo:  # what the row said about the forward (layers offloaded, bytes)
        said = [t for r in report.results if r.switch == "offload_activations" for t in r.runtime.values()]
        notes = "; ".join(filter(None, [notes, *(f"offload_activations: {t}" for t in said)]))
    if "tiled_mlp" in combo:  # the tiled path must have run (chunks of VERIFY_TILE_TOKENS)
        tiled = next((r.runtime.get("tiled", "") for r in report.results if r.switch == "tiled_mlp"), "")
        if not tiled or tiled.startswith("0 forwards tiled"):
            problems.append(f"tiled_mlp: no forward was tiled ({tiled or 'never called'})")
        notes = "; ".join(filter(None, [notes, tiled and f"tiled_mlp: {tiled}"]))
    if arbitrated:
        notes = "; ".join(filter(None, [notes, (
            f"{arbitrated} gradient{'s' if arbitrated > 1 else ''} over 1e-5 vs the unpatched fp32 model checked "
            f"against its fp64 run (within {FP64_ARBITER_FACTOR}x of the unpatched fp32 model's own error)")]))
    del patched, got
    gc.collect()
    return VerifyRow(name, list(combo), model_kind, batch_kind, sum(modules.values()), calls,
                     loss_error, loss_bound, grad_error, grad_bound, worst, problems, notes)


def _checkpointed_training(model) -> None:
    """``model`` (a patched copy) set up as offload_activations acts: gradient checkpointing (non-reentrant, as
    foak train uses it) and training mode on its decoder stacks and their layers only (what checkpointing and
    the offload rule look at), every other module left in eval mode (dropout off, as in the reference)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from foak.patching.offload import _layer_lists

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer) or _layer_lists(m):
            m.training = True


def _offload_counts(model) -> tuple[int, dict[str, int]]:
    """(checkpointed layers whose input the last forward offloaded, {why: layers kept on the device})."""
    from foak.patching.offload import _layer_lists, state_of

    offloaded, kept = 0, {}
    for m in model.modules():
        if _layer_lists(m):
            stats = state_of(m)
            offloaded += stats.get("offloaded_layers", 0)
            for key, why in (("kept_layers", "budget spent"), ("leaf_layers", "a leaf of the autograd graph")):
                if stats.get(key):
                    kept[why] = kept.get(why, 0) + stats[key]
    return offloaded, kept


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
    return (f"GPTQ model: its {n_gptq} GPTQLinear layers hold frozen 4-bit weights (no gradient), so the full "
            f"fine-tuning rows compare the loss and the gradients of the {len(trainable)} trainable parameters "
            f"({', '.join(kinds)}); those gradients flow back through every GPTQ layer's dequantizing backward. "
            "The LoRA rows put adapters on the GPTQ layers (foak's GPTQLoraLinear) and compare their gradients")


def format_report(report: VerifyReport) -> str:
    """The table of rows, then what was not checked and the verdict."""
    header = ("rule", "model", "batch", "modules", "fused calls/all", "loss err", "bound", "grad err", "bound",
              "worst parameter", "result")
    body = [(r.name, r.model_kind, r.batch_kind, str(r.modules), r.calls_text, f"{r.loss_error:.1e}",
             f"{r.loss_bound:.0e}" if r.loss_bound == FP32_TOLERANCE else f"{r.loss_bound:.1e}",
             f"{r.grad_error:.1e}", f"{r.grad_bound:.0e}" if r.grad_bound == FP32_TOLERANCE else f"{r.grad_bound:.1e}",
             r.worst_param, "PASS" if r.passed else "FAIL") for r in report.rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *body]]
    for r in report.rows:
        for p in r.problems:
            lines.append(f"FAIL {r.name} ({r.model_kind}, {r.batch_kind}): {p}")
    for r in report.rows:  # what the patch report said, once per rule (its row alone)
        if len(r.switches) == 1 and r.notes:
            lines.append(f"note: {r.notes}")
    if report.dtype == torch.float32:
        lines.append("errors: relative, of the loss and of each parameter's gradient vs the unpatched model's; "
                     "grad err is the worst parameter's")
    else:
        name = str(report.dtype).removeprefix("torch.")
        lines.append(f"errors: relative, vs an fp32 copy of the unpatched model, of the loss and of each "
                     f"parameter's gradient (grad err: the parameter nearest its bound); bound = max("
                     f"{LOW_PRECISION_FACTOR:g} x the unpatched {name} model's own error, a floor: "
                     f"{GRAD_FLOOR_UNITS * unit_roundoff(report.dtype):.2g} for gradients, "
                     f"{LOSS_FLOOR_UNITS * unit_roundoff(report.dtype):.2g} for the loss; never above "
                     f"{MAX_LOW_PRECISION_BOUND:g}, so a zeroed gradient always fails)")
    by_reason: dict[str, list[str]] = {}
    for s, why in report.skipped.items():
        by_reason.setdefault(why, []).append(s if SWITCH_KEYS[s] == s else f"{s} ({SWITCH_KEYS[s]})")
    for why, names in by_reason.items():
        lines.append(f"not checked: {', '.join(names)}: {why}")
    if report.unavailable:
        lines.append(f"no rule for this architecture: {', '.join(report.unavailable)}")
    failed = report.failed
    verdict = "PASS" if report.passed else "FAIL"
    text = f"verify: {verdict}: {len(report.rows) - len(failed)} of {len(report.rows)} checks passed"
    if failed:
        text += "; failed: " + ", ".join(f"{r.name} ({r.model_kind}, {r.batch_kind})" for r in failed)
    if report.skipped:
        text += f"; {len(report.skipped)} rule{'s' if len(report.skipped) > 1 else ''} not checked: " + \
            ", ".join(report.skipped)
    lines.append(text)
    return "\n".join(lines)
