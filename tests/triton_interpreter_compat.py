"""Test-only fixes for gaps of Triton's CPU interpreter (see ../shared/TRITON_CPU.md).

The interpreter casts fp32 -> bf16 by truncating the mantissa, while the GPU rounds to nearest even.
Kernels that store bf16 results (all of foak's) would then carry up to twice the rounding error on
CPU and disagree with torch's own bf16 arithmetic. This module replaces that one cast with torch's
conversion (round to nearest even), and makes ``tl.dot`` on bf16 operands multiply their values (the stock
interpreter multiplies the raw uint16 bit patterns). It touches the interpreter's private internals, so it is pinned to
the triton version of the test requirements, applied only when the interpreter is on, and never on a GPU.

One change is for speed only: the stock interpreter re-patches ``triton.language`` (``_patch_lang``: every builtin of
tl, tl.tensor and tl.math, found by ``inspect.getmembers``) at each call of a ``@triton.jit`` helper from inside a
kernel, although the kernel's launch has already patched those modules and keeps them patched until it ends; about a
third of the suite's interpreter time went there. Inside a running launch, a helper whose language modules are
already patched is called without patching them again (the same functions run either way).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import triton
import triton.language as tl

SUPPORTED_TRITON = ("3.8.", "3.9.")


def _round_to_bf16_bits(data: np.ndarray) -> np.ndarray:
    as_bf16 = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.bfloat16)
    return as_bf16.view(torch.int16).numpy().view(np.uint16)


def install() -> None:
    if not triton.__version__.startswith(SUPPORTED_TRITON):
        raise RuntimeError(
            f"tests/triton_interpreter_compat.py was written against triton {SUPPORTED_TRITON}, found "
            f"{triton.__version__}: re-check the interpreter's cast (InterpreterBuilder.cast_impl) and update it"
        )
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_foak_rounding", False):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_round_to_bf16_bits(src.data), tl.bfloat16)
        return original(self, src, dst_type)

    cast_impl._foak_rounding = True
    builder.cast_impl = cast_impl

    original_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            def values(h):  # bf16 bits -> fp32 values (exact); other dtypes as they are
                if h.dtype.scalar != tl.bfloat16:
                    return h.data.astype(np.float32)
                return (h.data.astype(np.uint32) << np.uint32(16)).view(np.float32)

            result = np.matmul(values(a), values(b), dtype=np.float32).astype(d.data.dtype) + d.data
            return interpreter.TensorHandle(result, d.dtype.scalar)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    _patch_lang_once_per_launch(interpreter)


def _lang_modules(fn) -> frozenset:
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


class _PoppingScope:
    """The launch's patch scope; its restore (at the end of the launch) also forgets the patched modules."""

    def __init__(self, scope, active: list):
        self._scope, self._active = scope, active

    def restore(self) -> None:
        self._active.pop()
        self._scope.restore()


class _NoScope:
    def restore(self) -> None:
        pass


def _patch_lang_once_per_launch(interpreter) -> None:
    active: list[frozenset] = []  # the language modules patched by each running launch (innermost last)
    original = interpreter._patch_lang

    def patch_lang(fn):
        langs = _lang_modules(fn)
        if not active:  # a launch (helpers are called only inside one): patched until its scope is restored
            scope = original(fn)
            active.append(langs)
            return _PoppingScope(scope, active)
        if langs <= active[-1]:
            return _NoScope()  # a helper inside a launch that has patched its modules already
        return original(fn)  # a helper seeing another language module: the stock behaviour

    interpreter._patch_lang = patch_lang
