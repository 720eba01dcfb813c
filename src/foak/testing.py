"""Numerical checks of foak's ops against their torch references.

Used by the test-suite, by ``foak verify --ops`` and by the GPU benchmark. A case runs an op forward
and backward on random inputs in one dtype and its reference on fp32 copies of the same (rounded)
values, and reports the relative error ``||out - ref|| / ||ref||`` of every output and gradient.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from foak.ops.activations import glu, glu_reference
from foak.ops.cross_entropy import cross_entropy, cross_entropy_reference
from foak.ops.glu_linear import glu_linear, glu_linear_reference
from foak.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from foak.ops.linear_jsd import linear_jsd, linear_jsd_reference
from foak.ops.linear_log_probs import linear_log_probs, linear_log_probs_reference
from foak.ops.lowrank import (
    lowrank_add_,
    lowrank_add_reference,
    lowrank_down,
    lowrank_down_reference,
    lowrank_tokens,
    lowrank_tokens_reference,
)
from foak.ops.rms_norm import rms_norm, rms_norm_reference
from foak.ops.rope import rope, rope_reference

# Relative-error budgets against an fp32 reference.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf if ``out`` holds a NaN/inf that ``ref`` does not."""
    out, ref = out.detach().double(), ref.detach().double()
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    if not torch.isfinite(out).all() and torch.isfinite(ref).all():
        return math.inf
    diff = (out - ref).norm().item()
    scale = ref.norm().item()
    return diff / scale if scale > 0 else diff


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


@dataclass
class Case:
    """One op call: ``make(dtype, device, generator)`` returns (kwargs, names of kwargs to differentiate)."""

    op: str
    name: str
    fn: Callable
    reference: Callable
    make: Callable
    dtypes: tuple = (torch.float32, torch.bfloat16)

    def run(self, dtype: torch.dtype, device="cpu", seed: int = 0) -> dict[str, float]:
        """Relative errors of each output (``out0``…) and each gradient (``grad_<name>``)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        kwargs, grad_names = self.make(dtype, torch.device(device), gen)
        leaves = {k: _leaf(v, k in grad_names) for k, v in kwargs.items()}
        ref_leaves = {k: _leaf(_upcast(v), k in grad_names) for k, v in kwargs.items()}
        outs = _as_tuple(self.fn(**leaves))
        refs = _as_tuple(self.reference(**ref_leaves))
        errors = {f"out{i}": relative_error(o, r) for i, (o, r) in enumerate(zip(outs, refs))}
        if grad_names:
            upstream = [torch.randn(o.shape, generator=gen).to(device=o.device, dtype=o.dtype) for o in outs]
            wrt = [leaves[n] for n in grad_names]
            grads = torch.autograd.grad(outs, wrt, upstream)
            ref_grads = torch.autograd.grad(refs, [ref_leaves[n] for n in grad_names], [u.float() for u in upstream])
            for n, g, rg in zip(grad_names, grads, ref_grads):
                errors[f"grad_{n}"] = relative_error(g, rg)
        return errors


def _upcast(v):
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v.float()
    return v


def _leaf(v, requires_grad: bool):
    if isinstance(v, torch.Tensor):
        return v.detach().clone().requires_grad_(requires_grad)
    return v


def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


# ---- cases ---------------------------------------------------------------------------------------
def rms_norm_case(shape, mode="llama", residual=False, name=None) -> Case:
    def make(dtype, device, gen):
        kw = {"x": _randn(shape, dtype, device, gen), "weight": _randn(shape[-1], dtype, device, gen, 0.5) + 1}
        if residual:
            kw["residual"] = _randn(shape, dtype, device, gen)
        return kw, tuple(kw)

    def call(fn):
        return lambda x, weight, residual=None: fn(x, weight, 1e-6, mode, residual)

    label = name or f"{mode}{'+residual' if residual else ''} {list(shape)}"
    return Case("rms_norm", label, call(rms_norm), call(rms_norm_reference), make)


def rope_case(batch, q_heads, k_heads, seq, head_dim, rotary_dim=None, cos_batch=1, packed=False,
              hf_layout=True, interleaved=False, name=None) -> Case:
    rot = rotary_dim or head_dim

    def make(dtype, device, gen):
        def qk(heads):
            if hf_layout:  # [B, S, H, D] storage seen as [B, H, S, D], as HF's attention makes it
                return _randn((batch, seq, heads, head_dim), dtype, device, gen).transpose(1, 2)
            return _randn((batch, heads, seq, head_dim), dtype, device, gen)

        kw = {"q": qk(q_heads), "k": qk(k_heads)}
        if packed:
            table = 2 * seq
            pos = torch.cat([torch.arange(n) for n in _packed_lengths(seq)])
            kw["position_ids"] = pos.expand(batch, seq).contiguous().to(device)
            angles = torch.rand((table, rot // 2), generator=gen) * 6.3
        else:
            angles = torch.rand((cos_batch, seq, rot // 2), generator=gen) * 6.3
        angles = torch.cat((angles, angles), dim=-1)
        kw["cos"], kw["sin"] = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
        return kw, ("q", "k")

    label = name or (f"q{[batch, q_heads, seq, head_dim]} kv_heads={k_heads} rot={rot}"
                     f"{' packed' if packed else ''}{' cos_batch=B' if cos_batch > 1 else ''}"
                     f"{' interleaved' if interleaved else ''}")
    if interleaved:
        return Case("rope", label, lambda **kw: rope(**kw, interleaved=True),
                    lambda **kw: rope_reference(**kw, interleaved=True), make)
    return Case("rope", label, rope, rope_reference, make)


def _packed_lengths(seq: int) -> list[int]:
    """Split ``seq`` into sequences of lengths 5, 7, 5, 7, ... (positions restart at each)."""
    lengths, left, i = [], seq, 0
    while left > 0:
        n = min(left, 5 if i % 2 == 0 else 7)
        lengths.append(n)
        left -= n
        i += 1
    return lengths


def glu_case(shape, activation="silu", chunked=False, name=None) -> Case:
    def make(dtype, device, gen):
        return {"g": _randn(shape, dtype, device, gen, 2.0), "u": _randn(shape, dtype, device, gen)}, ("g", "u")

    def call(fn):
        if not chunked:
            return lambda g, u: fn(g, u, activation)
        # g, u as strided halves of one intermediate tensor (a fused gate_up projection)
        return lambda g, u: fn(*torch.cat((g, u), dim=-1).chunk(2, dim=-1), activation)

    label = name or f"{activation} {list(shape)}{' chunked' if chunked else ''}"
    return Case("glu", label, call(glu), call(glu_reference), make)


def glu_linear_case(shape, out_features, activation="silu", bias=False, chunked=False, name=None) -> Case:
    def make(dtype, device, gen):
        kw = {"g": _randn(shape, dtype, device, gen, 2.0), "u": _randn(shape, dtype, device, gen),
              "weight": _randn((out_features, shape[-1]), dtype, device, gen, shape[-1] ** -0.5)}
        if bias:
            kw["bias"] = _randn(out_features, dtype, device, gen)
        return kw, tuple(kw)

    def call(fn):
        def run(g, u, weight, bias=None):
            if chunked:  # strided halves of one intermediate (a fused gate_up projection)
                g, u = torch.cat((g, u), dim=-1).chunk(2, dim=-1)
            return fn(g, u, weight, bias, activation)

        return run

    label = name or f"{activation} {list(shape)}->{out_features}{' +bias' if bias else ''}{' chunked' if chunked else ''}"
    return Case("glu_linear", label, call(glu_linear), call(glu_linear_reference), make)


def _describe(options: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in options.items())


def _targets(n, n_classes, gen, device):
    target = torch.randint(0, n_classes, (n,), generator=gen)
    target[torch.randperm(n, generator=gen)[: max(1, n // 7)]] = -100  # some rows ignored
    return target.to(device)


def cross_entropy_case(n, n_classes, name=None, **options) -> Case:
    def make(dtype, device, gen):
        return {"logits": _randn((n, n_classes), dtype, device, gen, 2.0),
                "target": _targets(n, n_classes, gen, device)}, ("logits",)

    label = name or f"[{n}, {n_classes}] {_describe(options)}".strip()
    return Case("cross_entropy", label, lambda **kw: cross_entropy(**kw, **options),
                lambda **kw: cross_entropy_reference(**kw, **options), make)


def linear_cross_entropy_case(n, hidden_size, n_classes, name=None, **options) -> Case:
    def make(dtype, device, gen):
        return {"hidden": _randn((n, hidden_size), dtype, device, gen),
                "weight": _randn((n_classes, hidden_size), dtype, device, gen, 0.3),
                "target": _targets(n, n_classes, gen, device)}, ("hidden", "weight")

    label = name or f"h[{n}, {hidden_size}] W[{n_classes}, {hidden_size}] {_describe(options)}".strip()
    return Case("linear_cross_entropy", label, lambda **kw: linear_cross_entropy(**kw, **options),
                lambda **kw: linear_cross_entropy_reference(**kw, **options), make)


def linear_log_probs_case(n, hidden_size, n_classes, **options) -> Case:
    """The per-row log-probabilities of the targets (TRL's fused LM head): the first output."""
    def make(dtype, device, gen):
        return {"hidden": _randn((n, hidden_size), dtype, device, gen),
                "weight": _randn((n_classes, hidden_size), dtype, device, gen, 0.3),
                "target": _targets(n, n_classes, gen, device)}, ("hidden", "weight")

    label = f"h[{n}, {hidden_size}] W[{n_classes}, {hidden_size}] {_describe(options)}".strip()
    return Case("linear_log_probs", label, lambda **kw: linear_log_probs(**kw, **options).log_probs,
                lambda **kw: linear_log_probs_reference(**kw, **options).log_probs, make)


def linear_jsd_case(n, hidden_size, n_classes, **options) -> Case:
    """The generalized JSD of a student head against a teacher head (TRL's distillation loss)."""
    def make(dtype, device, gen):
        mask = torch.ones(n, dtype=torch.long)
        mask[: max(1, n // 7)] = 0  # some rows left out
        return {"student_hidden": _randn((n, hidden_size), dtype, device, gen),
                "student_weight": _randn((n_classes, hidden_size), dtype, device, gen, 0.3),
                "teacher_hidden": _randn((n, hidden_size), dtype, device, gen),
                "teacher_weight": _randn((n_classes, hidden_size), dtype, device, gen, 0.3),
                "mask": mask.to(device)}, ("student_hidden", "student_weight")

    label = f"h[{n}, {hidden_size}] W[{n_classes}, {hidden_size}] {_describe(options)}".strip()
    return Case("linear_jsd", label, lambda **kw: linear_jsd(**kw, **options),
                lambda **kw: linear_jsd_reference(**kw, **options), make)


def lowrank_case(m, k, n, r) -> Case:
    """The three fp32 adapter products over an x (and out) of the case's dtype; no autograd (the LoRA ops call
    them in their forward and backward)."""
    def make(dtype, device, gen):
        return {"x": _randn((m, k), dtype, device, gen), "a": _randn((r, k), torch.float32, device, gen),
                "out": _randn((m, n), dtype, device, gen), "b": _randn((n, r), torch.float32, device, gen),
                "g": _randn((m, r), torch.float32, device, gen)}, ()

    def call(down, add_, tokens):
        return lambda x, a, out, b, g: (down(x, a, 0.5), add_(out.clone(), g, b, 0.5), tokens(x, g, 2.0))

    return Case("lowrank", f"x[{m}, {k}] a[{r}, {k}] out[{m}, {n}]",
                call(lowrank_down, lowrank_add_, lowrank_tokens),
                call(lowrank_down_reference, lowrank_add_reference, lowrank_tokens_reference), make)


# the ops of foak.ops that --ops does not run (their self-check cases are yet to be written); each is checked
# through the model rows of ``foak verify`` (the rule named) and by its own tests. ``foak verify --ops`` names them
OPS_NOT_SELF_CHECKED = {
    "lora": "fused_lora", "lora_glu_linear": "fused_lora", "moe": "fast_moe", "moe_router": "fast_moe",
    "nf4": "fused_lora on a QLoRA model", "gptq": "fused_lora on a GPTQ model",
    "gptq_matmul": "fused_lora on a GPTQ model", "varlen_attention": "fast_packed_attention",
    "tiled": "tiled_mlp",
}


def self_check_cases() -> list[Case]:
    """Small odd-shaped cases of the ops and variants ``foak verify --ops`` runs (every op but those of
    :data:`OPS_NOT_SELF_CHECKED`)."""
    return [
        rms_norm_case((37, 129)),
        rms_norm_case((3, 5, 257), mode="gemma"),
        rms_norm_case((7, 129), residual=True),
        rope_case(2, 5, 3, 7, 16),
        rope_case(2, 4, 2, 13, 16, rotary_dim=12, packed=True),
        glu_case((37, 129), "silu"),
        glu_case((5, 67), "gelu"),
        glu_case((5, 67), "gelu_tanh", chunked=True),
        glu_linear_case((3, 7, 129), 37, "silu"),
        glu_linear_case((13, 67), 21, "gelu_tanh", bias=True, chunked=True),
        cross_entropy_case(13, 1003, label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0),
        linear_cross_entropy_case(13, 33, 1003, reduction="sum"),
        linear_log_probs_case(13, 33, 1003, temperature=0.7, softcap=5.0),
        linear_jsd_case(13, 33, 1003, beta=0.3, temperature=2.0),
        lowrank_case(67, 130, 70, 7),
    ]


def run_self_check(device="cpu", dtypes=(torch.float32, torch.bfloat16)) -> list[dict]:
    """Run every self-check case; one row per (case, dtype) with its worst error and pass/fail."""
    rows = []
    for case in self_check_cases():
        for dtype in dtypes:
            errors = case.run(dtype, device)
            worst_key = max(errors, key=errors.get)
            tol = TOLERANCE[dtype]
            rows.append({
                "op": case.op, "case": case.name, "dtype": str(dtype).removeprefix("torch."),
                "worst": worst_key, "error": errors[worst_key], "tolerance": tol,
                "passed": all(e <= tol for e in errors.values()),
            })
    return rows


# bitsandbytes ------------------------------------------------------------------------------------------------
def _formula_dequantize_4bit(A, absmax, blocksize, quant_type, shape, dtype):
    from foak.ops.nf4 import NF4_LEVELS, nf4_dequantize_reference

    if quant_type != "nf4":
        raise NotImplementedError(f"foak.testing replaces bitsandbytes' CPU dequantize_4bit for NF4 only, not "
                                  f"{quant_type}")
    packed = A if A.dtype == torch.uint8 else A.view(torch.uint8)
    return nf4_dequantize_reference(packed.reshape(-1), absmax.float(), tuple(shape), dtype,
                                    code=torch.tensor(NF4_LEVELS, device=A.device), blocksize=blocksize)


@contextlib.contextmanager
def bitsandbytes_dequant_by_formula():
    """While open, where bitsandbytes' CPU ``dequantize_4bit`` differs from the NF4 formula on this machine
    (:func:`foak.patching.bnb_cpu.dequant_problem`: bitsandbytes 0.50.2 on AVX-512 CPUs), bitsandbytes' CPU
    kernel of that op is the formula (``nf4_dequantize_reference`` with the NF4 levels), so that a comparison with
    PEFT + bitsandbytes' ``Linear4bit`` (forward and backward, which dequantize through it) tests NF4 math and not
    that defect. Elsewhere bitsandbytes is left alone. Yields the problem (None when left alone). The checks'
    cached answers are forgotten on entry and exit (inside, bitsandbytes' CPU dequantization is right)."""
    from foak.patching import bnb_cpu

    problem = bnb_cpu.dequant_problem()
    if problem is None:
        yield None
        return
    library = torch.library.Library("bitsandbytes", "IMPL")
    library.impl("dequantize_4bit", _formula_dequantize_4bit, "CPU")
    bnb_cpu.forget()
    try:
        yield problem
    finally:
        library._destroy()  # bitsandbytes' own CPU kernel is the op's again
        bnb_cpu.forget()
