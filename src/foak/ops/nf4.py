"""Dequantization of NF4 weights (the 4-bit format of bitsandbytes / QLoRA), bit for bit as bitsandbytes.

Format (what ``bitsandbytes.functional.quantize_4bit(w, blocksize=64, quant_type="nf4")`` stores for a
weight of ``n = prod(shape)`` elements, taken in row-major order):

- ``packed``: ``ceil(n / 2)`` bytes. Byte ``i`` holds element ``2i`` in its high nibble (``q >> 4``) and
  element ``2i + 1`` in its low nibble (``q & 15``); for odd ``n`` the last low nibble is padding.
- ``code``: the 16 fp32 NF4 levels (quantiles of N(0, 1) scaled to [-1, 1]); a nibble is an index into it.
- ``absmax``: one fp32 scale per block of ``blocksize`` consecutive elements, ``ceil(n / blocksize)`` of
  them (the last block may be partial).

Element ``e`` with nibble ``k`` dequantizes to ``round_to_dtype(code[k] * absmax[e // blocksize])``: one
fp32 product, then one rounding to the output dtype (round to nearest even).

Double quantization (``compress_statistics=True``, QLoRA's "nested" absmax): ``absmax`` is then uint8,
indices into a 256-entry fp32 ``nested_code``, with one fp32 ``nested_absmax`` per ``nested_blocksize``
(256) blocks and one fp32 ``offset`` (the mean that was subtracted before quantizing). Block ``b``'s scale
is ``(nested_code[absmax[b]] * nested_absmax[b // nested_blocksize]) + offset``, rounded to fp32 after the
product and again after the sum (bitsandbytes runs the 8-bit dequantization, then the add, as separate
ops). The Triton kernel computes these scales itself, launched with ``enable_fp_fusion=False`` so that
the GPU compiler cannot contract the product and the sum into one FMA (one rounding, different bits);
``TUNING["absmax"] = "torch"`` computes them in torch before the launch instead.

:class:`NF4Weight` is a frozen quantized base weight in that format: the LoRA ops take it where they take
a dense weight and call :meth:`NF4Weight.dequantize` when they need one. This module knows nothing of
bitsandbytes' classes; the patching layer takes the raw tensors out of a ``QuantState``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from foak.backend import use_triton
from foak.ops._checks import check_not_sharded
from foak.ops._custom_op import custom_op

# The 16 NF4 levels (fp32), index = nibble: the ``code`` of every NF4 QuantState. They define the format, so
# tests and foak.patching.bnb_cpu decode weights with them instead of trusting a library's dequantization.
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' 4-bit block sizes
# Launch knobs: each program dequantizes this many packed bytes (twice as many outputs), a whole number of
# quantization blocks; "absmax": "kernel" (nested scales computed in the kernel) or "torch" (before it).
TUNING = {"bytes_per_program": 1024, "warps": 4, "absmax": "kernel"}


# 1. reference -------------------------------------------------------------------------------------
def _absmax_reference(absmax, nested_absmax, nested_code, nested_blocksize, offset) -> torch.Tensor:
    """fp32 block scales: ``absmax`` itself, or (nested) ``code2[q] * absmax2[b // bs2]`` then ``+ offset``."""
    if nested_absmax is None:
        return absmax.reshape(-1)
    blocks = torch.arange(absmax.numel(), device=absmax.device)
    scales = nested_code[absmax.reshape(-1).long()] * nested_absmax.reshape(-1)[blocks // nested_blocksize]
    return scales + offset.reshape(())  # a second rounding, not an FMA


def nf4_dequantize_reference(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype,
    *,
    code: torch.Tensor,
    blocksize: int = 64,
    nested_absmax: torch.Tensor | None = None,
    nested_code: torch.Tensor | None = None,
    nested_blocksize: int = 256,
    offset: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """The math in plain torch (integer nibble extraction, gathers, one fp32 product, one cast).
    Arguments as :func:`nf4_dequantize`; no validation."""
    n = math.prod(shape)
    if nested_absmax is not None and not isinstance(offset, torch.Tensor):
        offset = torch.tensor(float(offset), dtype=torch.float32, device=packed.device)
    scales = _absmax_reference(absmax, nested_absmax, nested_code, nested_blocksize, offset)
    q = packed.reshape(-1).long()
    nibbles = torch.stack((q >> 4, q & 15), dim=1).reshape(-1)[:n]  # the high nibble is the first element
    elements = torch.arange(n, device=packed.device)
    return (code[nibbles] * scales[elements // blocksize]).to(dtype).reshape(tuple(shape))


# 2. kernel ----------------------------------------------------------------------------------------
@triton.jit
def _nf4_dequantize_kernel(
    PACKED, ABSMAX, CODE, NESTED_ABSMAX, NESTED_CODE, OFFSET, OUT,
    n_elements, n_bytes, n_blocks,
    BLOCKSIZE: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
    NESTED: tl.constexpr,
):
    # A program owns BLOCKS_PER_PROGRAM whole quantization blocks: a [blocks, BLOCKSIZE // 2] tile of
    # bytes, one scale per row, written out as a [blocks, BLOCKSIZE] tile of interleaved nibbles.
    HALF: tl.constexpr = BLOCKSIZE // 2
    pid = tl.program_id(0).to(tl.int64)
    blocks = pid * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    block_ok = blocks < n_blocks
    if NESTED:
        qscale = tl.load(ABSMAX + blocks, mask=block_ok, other=0).to(tl.int32)
        scale2 = tl.load(NESTED_ABSMAX + blocks // NESTED_BLOCKSIZE, mask=block_ok, other=0.0)
        # product and sum rounded separately: the launch passes enable_fp_fusion=False
        scale = tl.load(NESTED_CODE + qscale) * scale2 + tl.load(OFFSET)
    else:
        scale = tl.load(ABSMAX + blocks, mask=block_ok, other=0.0)
    byte = blocks[:, None] * HALF + tl.arange(0, HALF)[None, :]
    q = tl.load(PACKED + byte, mask=byte < n_bytes, other=0).to(tl.int32)
    first = tl.load(CODE + (q >> 4)) * scale[:, None]
    second = tl.load(CODE + (q & 15)) * scale[:, None]
    values = tl.interleave(first, second)
    element = blocks[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    tl.store(OUT + element, values.to(OUT.dtype.element_ty), mask=element < n_elements)


# 3. launcher --------------------------------------------------------------------------------------
def _launch(packed, absmax, shape, dtype, code, blocksize, nested_absmax, nested_code, nested_blocksize, offset):
    n = math.prod(shape)
    out = torch.empty(tuple(shape), dtype=dtype, device=packed.device)
    if n == 0:
        return out
    nested = nested_absmax is not None
    if nested and TUNING["absmax"] == "torch":
        absmax = _absmax_reference(absmax, nested_absmax, nested_code, nested_blocksize, offset)
        nested = False
    n_blocks = absmax.numel()
    per_program = max(1, TUNING["bytes_per_program"] // (blocksize // 2))
    per_program = min(triton.next_power_of_2(per_program), triton.next_power_of_2(n_blocks))
    dummy = absmax  # unread when not nested
    _nf4_dequantize_kernel[(triton.cdiv(n_blocks, per_program),)](
        packed, absmax, code,
        nested_absmax if nested else dummy, nested_code if nested else dummy, offset if nested else dummy, out,
        n, packed.numel(), n_blocks,
        BLOCKSIZE=blocksize, NESTED_BLOCKSIZE=nested_blocksize if nested else 1, BLOCKS_PER_PROGRAM=per_program,
        NESTED=nested, num_warps=TUNING["warps"], enable_fp_fusion=False,
    )
    return out


# 4. custom op (so torch.compile traces through) ---------------------------------------------------
def _dequantize_fake(packed, absmax, shape, dtype, code, blocksize, nested_absmax, nested_code, nested_blocksize,
                     offset):
    return packed.new_empty(tuple(shape), dtype=dtype)


@custom_op("nf4_dequantize", _dequantize_fake)
def _dequantize_op(
    packed: torch.Tensor, absmax: torch.Tensor, shape: list[int], dtype: torch.dtype, code: torch.Tensor,
    blocksize: int, nested_absmax: torch.Tensor | None, nested_code: torch.Tensor | None, nested_blocksize: int,
    offset: torch.Tensor | None,
) -> torch.Tensor:
    return _launch(packed, absmax, shape, dtype, code, blocksize, nested_absmax, nested_code, nested_blocksize,
                   offset)


# 5. public functions ------------------------------------------------------------------------------
_OP = "nf4_dequantize"


def _tensor(name: str, t, dtype: torch.dtype, device: torch.device, numel: int | None, hint: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}. {hint}")
    if t.dtype != dtype:
        raise ValueError(f"{_OP}: {name} has dtype {t.dtype}; expected {dtype}. {hint}")
    if t.device != device:
        raise ValueError(f"{_OP}: {name} is on {t.device} but packed is on {device}; move it to {device}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{_OP}: {name} has {t.numel()} elements; expected {numel}. {hint}")
    flat = t if t.dim() == 1 else t.reshape(-1)  # (reshape costs a few microseconds per call)
    return flat if flat.is_contiguous() else flat.contiguous()


def _prepare(packed, absmax, shape, dtype, code, blocksize, nested_absmax, nested_code, nested_blocksize, offset):
    """Validate, and return the arguments flattened and contiguous (offset as a 1-element fp32 tensor)."""
    if isinstance(shape, (tuple, list)) or (isinstance(shape, Sequence) and not isinstance(shape, str)):
        shape = tuple(shape)  # (torch.Size is a tuple)
    if not isinstance(shape, tuple) or not all((type(s) is int or isinstance(s, numbers.Integral)) and s >= 0
                                               for s in shape):
        raise ValueError(f"{_OP}: shape must be a sequence of non-negative ints (the weight's shape), got {shape!r}")
    shape = tuple(int(s) for s in shape)
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"{_OP}: dtype must be one of torch.float32, torch.bfloat16, torch.float16; got {dtype!r}")
    if type(blocksize) is not int and (isinstance(blocksize, bool) or not isinstance(blocksize, numbers.Integral)) \
            or blocksize not in BLOCKSIZES:
        raise ValueError(f"{_OP}: blocksize must be one of {BLOCKSIZES} (bitsandbytes' quant_state.blocksize), "
                         f"got {blocksize!r}")
    blocksize = int(blocksize)
    if not isinstance(packed, torch.Tensor):
        raise ValueError(f"{_OP}: packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise ValueError(f"{_OP}: packed has dtype {packed.dtype}; expected torch.uint8 (pass packed.view(torch.uint8) "
                         "for weights stored with another quant_storage dtype)")
    device = packed.device
    n = math.prod(shape)
    packed = _tensor("packed", packed, torch.uint8, device, (n + 1) // 2,
                     f"A weight of shape {shape} packs two elements per byte.")
    n_blocks = -(-n // blocksize)
    code = _tensor("code", code, torch.float32, device, 16, "Pass the 16 NF4 levels (quant_state.code).")
    nested_parts = {"nested_absmax": nested_absmax, "nested_code": nested_code, "offset": offset}
    if not isinstance(absmax, torch.Tensor):
        raise ValueError(f"{_OP}: absmax must be a torch.Tensor, got {type(absmax).__name__}")
    if absmax.dtype == torch.uint8:
        missing = [k for k, v in nested_parts.items() if v is None]
        if missing:
            raise ValueError(f"{_OP}: absmax is uint8 (double-quantized) but {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} missing: pass nested_absmax="
                             "quant_state.state2.absmax, nested_code=quant_state.state2.code, "
                             "nested_blocksize=quant_state.state2.blocksize and offset=quant_state.offset")
        if type(nested_blocksize) is not int and (isinstance(nested_blocksize, bool)
                                                  or not isinstance(nested_blocksize, numbers.Integral)) \
                or nested_blocksize <= 0:
            raise ValueError(f"{_OP}: nested_blocksize must be a positive int (quant_state.state2.blocksize), "
                             f"got {nested_blocksize!r}")
        nested_blocksize = int(nested_blocksize)
        absmax = _tensor("absmax", absmax, torch.uint8, device, n_blocks,
                         f"A weight of {n} elements has ceil({n} / blocksize={blocksize}) blocks.")
        nested_absmax = _tensor("nested_absmax", nested_absmax, torch.float32, device,
                                -(-n_blocks // nested_blocksize),
                                f"{n_blocks} blocks make ceil({n_blocks} / nested_blocksize={nested_blocksize}) "
                                "nested blocks (quant_state.state2.absmax).")
        nested_code = _tensor("nested_code", nested_code, torch.float32, device, 256,
                              "Pass the 256-entry 8-bit code (quant_state.state2.code).")
        if isinstance(offset, numbers.Real) and not isinstance(offset, bool):
            offset = torch.tensor([float(offset)], dtype=torch.float32, device=device)
        offset = _tensor("offset", offset, torch.float32, device, 1,
                         "Pass quant_state.offset (a one-element fp32 tensor, or a float).")
    elif absmax.dtype == torch.float32:
        given = [k for k, v in nested_parts.items() if v is not None]
        if given:
            raise ValueError(f"{_OP}: {', '.join(given)} given but absmax is fp32 (not double-quantized); pass the "
                             "uint8 quant_state.absmax with them, or leave them out")
        absmax = _tensor("absmax", absmax, torch.float32, device, n_blocks,
                         f"A weight of {n} elements has ceil({n} / blocksize={blocksize}) blocks.")
        nested_absmax = nested_code = offset = None
    else:
        raise ValueError(f"{_OP}: absmax has dtype {absmax.dtype}; expected torch.float32 (one scale per block) "
                         "or torch.uint8 (double-quantized, with nested_absmax, nested_code and offset)")
    return packed, absmax, shape, dtype, code, blocksize, nested_absmax, nested_code, nested_blocksize, offset


def nf4_dequantize(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype,
    *,
    code: torch.Tensor,
    blocksize: int = 64,
    nested_absmax: torch.Tensor | None = None,
    nested_code: torch.Tensor | None = None,
    nested_blocksize: int = 256,
    offset: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Dequantize an NF4 weight to a new contiguous tensor of ``shape`` and ``dtype`` (fp32, bf16 or fp16).

    ``packed``: uint8, any shape, ``ceil(prod(shape) / 2)`` bytes. ``code``: the 16 fp32 NF4 levels.
    ``absmax``: fp32 ``[ceil(prod(shape) / blocksize)]``, or uint8 when double-quantized, then with
    ``nested_absmax`` (fp32, one per ``nested_blocksize`` blocks), ``nested_code`` (fp32 [256]) and ``offset``
    (a one-element fp32 tensor or a float). From a bitsandbytes ``QuantState`` ``qs``: ``absmax=qs.absmax,
    shape=qs.shape, dtype=qs.dtype, code=qs.code, blocksize=qs.blocksize`` and, if ``qs.nested``,
    ``nested_absmax=qs.state2.absmax, nested_code=qs.state2.code, nested_blocksize=qs.state2.blocksize,
    offset=qs.offset``. The result is the NF4 formula's, and so ``bitsandbytes.functional.dequantize_4bit``'s bit
    for bit (on CUDA; on CPU where bitsandbytes' own kernel is right, see foak.patching.bnb_cpu).
    """
    args = _prepare(packed, absmax, shape, dtype, code, blocksize, nested_absmax, nested_code, nested_blocksize,
                    offset)
    return _dequantize(*args)


def _dequantize(packed, absmax, shape, dtype, code, blocksize, nested_absmax, nested_code, nested_blocksize, offset):
    """nf4_dequantize on validated, flattened arguments."""
    if not use_triton(packed.device):
        return nf4_dequantize_reference(packed, absmax, shape, dtype, code=code, blocksize=blocksize,
                                        nested_absmax=nested_absmax, nested_code=nested_code,
                                        nested_blocksize=nested_blocksize, offset=offset)
    return _dequantize_op(packed, absmax, list(shape), dtype, code, blocksize, nested_absmax, nested_code,
                          nested_blocksize, offset)


class NF4Weight:
    """A frozen NF4-quantized ``[out, in]`` weight, which the LoRA ops take in place of a dense weight.

    Built from the raw tensors (arguments as :func:`nf4_dequantize`; ``shape`` must be 2-D, ``dtype`` is the
    compute dtype the weight dequantizes to, bitsandbytes' ``quant_state.dtype``), validated once here.
    ``shape``, ``device``, ``dtype`` and ``requires_grad`` (always False) mirror a weight tensor's;
    :meth:`dequantize` returns a fresh dense copy.
    """

    __slots__ = ("_args", "shape", "device", "dtype")
    requires_grad = False

    def __init__(
        self,
        packed: torch.Tensor,
        absmax: torch.Tensor,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        code: torch.Tensor,
        blocksize: int = 64,
        nested_absmax: torch.Tensor | None = None,
        nested_code: torch.Tensor | None = None,
        nested_blocksize: int = 256,
        offset: torch.Tensor | float | None = None,
    ):
        if isinstance(shape, (torch.Size, Sequence)) and len(shape) != 2:
            raise ValueError(f"NF4Weight: shape must be 2-D [out_features, in_features], got {tuple(shape)}")
        for name, t in (("packed", packed), ("absmax", absmax), ("nested_absmax", nested_absmax)):
            check_not_sharded("NF4Weight", name, t)
        self._args = _prepare(packed, absmax, shape, dtype, code, blocksize, nested_absmax, nested_code,
                              nested_blocksize, offset)
        self.shape = torch.Size(self._args[2])
        self.device = packed.device
        self.dtype = dtype

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new contiguous ``[out, in]`` tensor of ``dtype`` (default: :attr:`dtype`)."""
        dtype = self.dtype if dtype is None else dtype
        if dtype not in OUTPUT_DTYPES:
            raise ValueError(f"NF4Weight.dequantize: dtype must be one of torch.float32, torch.bfloat16, "
                             f"torch.float16 or None (the weight's {self.dtype}); got {dtype!r}")
        packed, absmax, shape, _, *rest = self._args
        return _dequantize(packed, absmax, shape, dtype, *rest)

    def __repr__(self) -> str:
        nested = ", nested" if self._args[6] is not None else ""
        return (f"NF4Weight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"blocksize={self._args[5]}{nested})")
