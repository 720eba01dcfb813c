"""GPTQ 4-bit weights: dequantization (torch reference and Triton kernel), a frozen weight for the LoRA ops,
and a round-to-nearest quantizer that writes the same format.

Format (the "gptq" checkpoint layout of AutoGPTQ / GPTQModel; a linear layer ``y = x W^T`` with ``W`` of
shape ``[out_features, in_features]``, written here as the ``[in, out]`` integer matrix ``q``):

- ``qweight``: int32 ``[in_features // 8, out_features]``. ``q[i, j]`` (0..15) sits in ``qweight[i // 8, j]``
  at bits ``4 * (i % 8)`` to ``4 * (i % 8) + 3``: the lowest nibble holds the first of eight input channels.
- ``qzeros``: int32 ``[n_groups, out_features // 8]``. The stored zero point of group ``g`` and output ``j``
  sits in ``qzeros[g, j // 8]`` at bits ``4 * (j % 8)`` to ``4 * (j % 8) + 3``.
- ``scales``: ``[n_groups, out_features]``, fp16 in most checkpoints (bf16 and fp32 are read too).
- ``g_idx``: int32 (or int64) ``[in_features]``, the group of each input channel. Without act-order it is
  ``i // group_size`` (``group_size = -1``: one group, all zeros); with act-order (``desc_act``) the channels
  were quantized in a permuted order and ``g_idx[i] = rank(i) // group_size``, ``qweight`` staying in the
  original channel order.
- The zero point is ``zero = stored + zero_offset``: ``zero_offset = 1`` for "gptq" (v1) checkpoints, which
  store ``zero - 1`` (the old format's offset), ``0`` for "gptq_v2", which store the zero itself. Symmetric
  quantization uses ``zero = 8`` everywhere (stored 7 in v1); asymmetric any zero in 0..15 (v1 can store
  1..16).

foak's dequantization (what the kernel and the reference both compute, bit for bit)::

    W[j, i] = round_to_dtype(fp32(scales[g, j]) * fp32(q[i, j] - zero[g, j])),   g = g_idx[i]

``q - zero`` is an integer in -16..15, so the fp32 product of an fp16/bf16 scale (at most 11 significant
bits) and it (at most 5) is exact: the result is the exact value, rounded once (to nearest even) to the
output dtype. With fp32 scales the product is one IEEE fp32 multiplication, the same in torch and Triton.

:class:`GPTQWeight` is a frozen quantized base weight in that format: the LoRA ops (foak.ops.lora, "quantized
bases") take it in place of a dense weight and call :meth:`GPTQWeight.dequantize`. It is validated once, and
finds out once whether ``g_idx`` is the plain ``i // group_size``: then each kernel program reads one scale
and zero per output row of its tile (a tile never straddles a group); otherwise (act-order) it gathers the
scale and zero of each input channel. :func:`gptq_quantize_rtn` writes the format without calibration data
(round to nearest; act-order orders channels by descending column norm), :func:`gptq_error_report` says how
far a packed weight is from the dense one. This module imports no GPTQ library; the loader reads the tensors.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from foak.backend import use_triton
from foak.ops._checks import check_not_sharded
from foak.ops._custom_op import custom_op

OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
BITS = 4
PACK = 32 // BITS  # values per int32
# Launch knobs: a program dequantizes a [block_out, block_in] tile of W (powers of 2, block_in >= 8);
# "unpack": "reshape" (one load per int32, split into 8 nibbles) or "gather" (the int32 loaded per element);
# "layout" (plain groups) / "act_order_layout" (act-order): "out_major" builds the tile as [out, in] (the
# output's order), "in_major" as [in, out] (the order of qweight, scales and qzeros: coalesced gathers of
# the act-order scales and zeros), leaving the transpose to the compiler.
# act_order_block_out / act_order_block_in: the tile under act-order. Defaults from the H200 sweep
# (benchmarks/results/gptq_h200.json).
TUNING = {"block_out": 64, "block_in": 128, "warps": 4, "unpack": "reshape", "layout": "out_major",
          "act_order_layout": "in_major", "act_order_block_out": 128, "act_order_block_in": 32}


# 1. reference -------------------------------------------------------------------------------------
def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] int32 -> [..., n, 8] int32: the 8 nibbles of each, lowest first."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)
    return (packed.unsqueeze(-1) >> shifts) & 15


def gptq_dequantize_reference(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    dtype: torch.dtype,
    *,
    zero_offset: int = 1,
) -> torch.Tensor:
    """The format's formula in plain torch (integer unpacking, gathers by ``g_idx``, one fp32 product, one
    cast). Arguments as :func:`gptq_dequantize`, no validation; returns a new contiguous ``[out, in]``."""
    n_in8, out_features = qweight.shape
    q = _nibbles(qweight).permute(0, 2, 1).reshape(n_in8 * PACK, out_features)  # [in, out]
    zeros = _nibbles(qzeros).reshape(qzeros.shape[0], out_features) + zero_offset  # [groups, out]
    g = g_idx.long()
    w = scales[g].float() * (q - zeros[g]).float()  # [in, out], exact for fp16/bf16 scales
    return w.t().contiguous().to(dtype)


# 2. kernel ----------------------------------------------------------------------------------------
@triton.jit
def _gptq_dequantize_kernel(
    QWEIGHT, QZEROS, SCALES, G_IDX, OUT,
    in_features, out_features, zero_cols, group_size,
    ZERO_OFFSET: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr,
    GROUPED: tl.constexpr, RESHAPE: tl.constexpr,
):
    # A program owns the [BLOCK_OUT, BLOCK_IN] tile W[j, i] (rows j: output features, columns i: input).
    pid_in = tl.program_id(0)
    pid_out = tl.program_id(1)
    j = pid_out * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    i = pid_in * BLOCK_IN + tl.arange(0, BLOCK_IN)
    j_ok = j < out_features
    i_ok = i < in_features
    tile_ok = j_ok[:, None] & i_ok[None, :]
    if RESHAPE:
        # each int32 once: [BLOCK_OUT, BLOCK_IN // 8] words, split into [.., .., 8] nibbles, in order
        EIGHTHS: tl.constexpr = BLOCK_IN // 8
        words = pid_in * EIGHTHS + tl.arange(0, EIGHTHS)
        packed = tl.load(QWEIGHT + words[None, :] * out_features + j[:, None],
                         mask=j_ok[:, None] & (words < in_features // 8)[None, :], other=0)
        shifts = tl.arange(0, 8) * 4
        q = tl.reshape((packed[:, :, None] >> shifts[None, None, :]) & 15, (BLOCK_OUT, BLOCK_IN))
    else:
        packed = tl.load(QWEIGHT + (i // 8)[None, :] * out_features + j[:, None], mask=tile_ok, other=0)
        q = (packed >> ((i % 8) * 4)[None, :]) & 15
    if GROUPED:
        # g_idx[i] == i // group_size and the tile lies in one group: one scale and zero per row
        group = (pid_in * BLOCK_IN) // group_size
        scale = tl.load(SCALES + group * out_features + j, mask=j_ok, other=0.0).to(tl.float32)
        zword = tl.load(QZEROS + group * zero_cols + j // 8, mask=j_ok, other=0)
        zero = ((zword >> ((j % 8) * 4)) & 15) + ZERO_OFFSET
        w = scale[:, None] * (q - zero[:, None]).to(tl.float32)
    else:
        # act-order (any g_idx): the scale and zero of each input channel's group
        g = tl.load(G_IDX + i, mask=i_ok, other=0)
        scale = tl.load(SCALES + g[None, :] * out_features + j[:, None], mask=tile_ok, other=0.0).to(tl.float32)
        zword = tl.load(QZEROS + g[None, :] * zero_cols + (j // 8)[:, None], mask=tile_ok, other=0)
        zero = ((zword >> ((j % 8) * 4)[:, None]) & 15) + ZERO_OFFSET
        w = scale * (q - zero).to(tl.float32)
    rows = j.to(tl.int64)[:, None] * in_features
    tl.store(OUT + rows + i[None, :], w.to(OUT.dtype.element_ty), mask=tile_ok)


@triton.jit
def _gptq_dequantize_in_major_kernel(
    QWEIGHT, QZEROS, SCALES, G_IDX, OUT,
    in_features, out_features, zero_cols, group_size,
    ZERO_OFFSET: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, GROUPED: tl.constexpr,
):
    # The same tile as _gptq_dequantize_kernel's, built as [BLOCK_IN, BLOCK_OUT] (input channel i, output j).
    pid_in = tl.program_id(0)
    pid_out = tl.program_id(1)
    j = pid_out * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    i = pid_in * BLOCK_IN + tl.arange(0, BLOCK_IN)
    j_ok = j < out_features
    i_ok = i < in_features
    tile_ok = i_ok[:, None] & j_ok[None, :]
    EIGHTHS: tl.constexpr = BLOCK_IN // 8
    words = pid_in * EIGHTHS + tl.arange(0, EIGHTHS)
    packed = tl.load(QWEIGHT + words[:, None] * out_features + j[None, :],
                     mask=(words < in_features // 8)[:, None] & j_ok[None, :], other=0)  # [EIGHTHS, BLOCK_OUT]
    shifts = tl.arange(0, 8) * 4
    q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 15, (BLOCK_IN, BLOCK_OUT))
    if GROUPED:
        group = (pid_in * BLOCK_IN) // group_size
        scale = tl.load(SCALES + group * out_features + j, mask=j_ok, other=0.0).to(tl.float32)
        zword = tl.load(QZEROS + group * zero_cols + j // 8, mask=j_ok, other=0)
        zero = ((zword >> ((j % 8) * 4)) & 15) + ZERO_OFFSET
        w = scale[None, :] * (q - zero[None, :]).to(tl.float32)
    else:
        g = tl.load(G_IDX + i, mask=i_ok, other=0)
        scale = tl.load(SCALES + g[:, None] * out_features + j[None, :], mask=tile_ok, other=0.0).to(tl.float32)
        zword = tl.load(QZEROS + g[:, None] * zero_cols + (j // 8)[None, :], mask=tile_ok, other=0)
        zero = ((zword >> ((j % 8) * 4)[None, :]) & 15) + ZERO_OFFSET
        w = scale * (q - zero).to(tl.float32)
    cols = j.to(tl.int64)[None, :] * in_features
    tl.store(OUT + cols + i[:, None], w.to(OUT.dtype.element_ty), mask=tile_ok)


# 3. launcher --------------------------------------------------------------------------------------
def _launch(qweight, qzeros, scales, g_idx, dtype, zero_offset, group_size):
    in_features, out_features = qweight.shape[0] * PACK, qweight.shape[1]
    out = torch.empty((out_features, in_features), dtype=dtype, device=qweight.device)
    block_out, block_in = TUNING["block_out"], TUNING["block_in"]
    grouped = group_size > 0 and (group_size >= in_features or group_size % block_in == 0)
    if not grouped:
        block_out, block_in = TUNING["act_order_block_out"], TUNING["act_order_block_in"]
    grid = (triton.cdiv(in_features, block_in), triton.cdiv(out_features, block_out))
    layout = TUNING["layout"] if grouped else TUNING["act_order_layout"]
    if layout == "in_major":
        _gptq_dequantize_in_major_kernel[grid](
            qweight, qzeros, scales, g_idx, out,
            in_features, out_features, out_features // PACK, group_size if grouped else 1,
            ZERO_OFFSET=zero_offset, BLOCK_OUT=block_out, BLOCK_IN=block_in, GROUPED=grouped,
            num_warps=TUNING["warps"],
        )
        return out
    _gptq_dequantize_kernel[grid](
        qweight, qzeros, scales, g_idx, out,
        in_features, out_features, out_features // PACK, group_size if grouped else 1,
        ZERO_OFFSET=zero_offset, BLOCK_OUT=block_out, BLOCK_IN=block_in, GROUPED=grouped,
        RESHAPE=TUNING["unpack"] == "reshape", num_warps=TUNING["warps"],
    )
    return out


# 4. custom op (so torch.compile traces through) ---------------------------------------------------
def _dequantize_fake(qweight, qzeros, scales, g_idx, dtype, zero_offset, group_size):
    return qweight.new_empty((qweight.shape[1], qweight.shape[0] * PACK), dtype=dtype)


@custom_op("gptq_dequantize", _dequantize_fake)
def _dequantize_op(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                   dtype: torch.dtype, zero_offset: int, group_size: int) -> torch.Tensor:
    return _launch(qweight, qzeros, scales, g_idx, dtype, zero_offset, group_size)


# 5. public functions ------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def _check_tensor(op, name, t, dtypes, dims, device, hint=""):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    check_not_sharded(op, name, t)
    if t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; expected {names}. {hint}".rstrip())
    if t.dim() != dims:
        raise ValueError(f"{op}: {name} must be {dims}-D, got shape {tuple(t.shape)}. {hint}".rstrip())
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but qweight is on {device}; move it to {device}")
    return t if t.is_contiguous() else t.contiguous()


def _group_size_of(g_idx: torch.Tensor, n_groups: int, op: str) -> int:
    """Check 0 <= g_idx < n_groups; return s when g_idx == arange(in) // s (no act-order), else 0.
    One host synchronisation."""
    in_features = g_idx.numel()
    size = (g_idx == 0).sum()  # the group size, if g_idx is plain
    plain = torch.arange(in_features, device=g_idx.device) // size.clamp(min=1)
    lo, hi, s, mismatches = torch.stack(
        (g_idx.min().long(), g_idx.max().long(), size, (g_idx != plain).sum())).tolist()
    if lo < 0 or hi >= n_groups:
        raise ValueError(f"{op}: g_idx holds groups {lo}..{hi} but scales and qzeros have {n_groups} groups "
                         f"(rows): each g_idx entry must be in 0..{n_groups - 1}")
    return int(s) if mismatches == 0 else 0


def _prepare(qweight, qzeros, scales, g_idx, dtype, zero_offset, bits, op):
    """Validate; return (qweight, qzeros, scales, g_idx) contiguous, dtype, zero_offset and the plain group
    size (0 for act-order)."""
    if not _is_int(bits) or bits != BITS:
        raise ValueError(f"{op}: bits={bits!r} is not supported: foak reads 4-bit GPTQ weights only (bits=4)")
    if not _is_int(zero_offset) or zero_offset not in (0, 1):
        raise ValueError(f"{op}: zero_offset must be 1 (\"gptq\" v1 checkpoints, which store zero - 1) or 0 "
                         f"(\"gptq_v2\"); got {zero_offset!r}")
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"{op}: dtype must be one of torch.float32, torch.bfloat16, torch.float16; got {dtype!r}")
    qweight = _check_tensor(op, "qweight", qweight, (torch.int32,), 2, None,
                            "GPTQ packs eight 4-bit values per int32: [in_features // 8, out_features].")
    device = qweight.device
    n_in8, out_features = qweight.shape
    in_features = n_in8 * PACK
    if n_in8 == 0 or out_features == 0:
        raise ValueError(f"{op}: qweight has shape {tuple(qweight.shape)}; a GPTQ weight must not be empty")
    if out_features % PACK:
        raise ValueError(f"{op}: out_features (qweight.shape[1]) is {out_features}; it must be a multiple of 8 "
                         "(qzeros packs eight output features per int32)")
    g_idx = _check_tensor(op, "g_idx", g_idx, INDEX_DTYPES, 1, device,
                          "g_idx is the group of each input channel (gptq_group_index(in_features, group_size) "
                          "builds the plain one).")
    if g_idx.numel() != in_features:
        extra = "; in_features must be a multiple of 8" if g_idx.numel() % PACK else ""
        raise ValueError(f"{op}: g_idx has {g_idx.numel()} entries but qweight {tuple(qweight.shape)} holds "
                         f"in_features = 8 * {n_in8} = {in_features} input channels{extra}")
    scales = _check_tensor(op, "scales", scales, SCALE_DTYPES, 2, device)
    n_groups = scales.shape[0]
    if n_groups == 0 or scales.shape[1] != out_features:
        raise ValueError(f"{op}: scales must be [n_groups >= 1, out_features={out_features}]; got "
                         f"{tuple(scales.shape)}")
    qzeros = _check_tensor(op, "qzeros", qzeros, (torch.int32,), 2, device)
    if tuple(qzeros.shape) != (n_groups, out_features // PACK):
        raise ValueError(f"{op}: qzeros must be [n_groups, out_features // 8] = [{n_groups}, {out_features // PACK}] "
                         f"(n_groups from scales {tuple(scales.shape)}); got {tuple(qzeros.shape)}")
    group_size = _group_size_of(g_idx, n_groups, op)
    return qweight, qzeros, scales, g_idx, dtype, int(zero_offset), group_size


def _dequantize(qweight, qzeros, scales, g_idx, dtype, zero_offset, group_size):
    """gptq_dequantize on validated arguments."""
    if not use_triton(qweight.device):
        return gptq_dequantize_reference(qweight, qzeros, scales, g_idx, dtype, zero_offset=zero_offset)
    return _dequantize_op(qweight, qzeros, scales, g_idx, dtype, zero_offset, group_size)


def gptq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    *,
    dtype: torch.dtype,
    zero_offset: int = 1,
    bits: int = 4,
) -> torch.Tensor:
    """Dequantize a GPTQ 4-bit weight to a new contiguous ``[out_features, in_features]`` tensor of ``dtype``
    (fp32, bf16 or fp16), as ``nn.Linear`` holds it (see the module docstring for the format and the math).

    ``qweight`` int32 ``[in // 8, out]``, ``qzeros`` int32 ``[n_groups, out // 8]``, ``scales``
    ``[n_groups, out]`` (fp16, bf16 or fp32), ``g_idx`` int32/int64 ``[in]``. ``zero_offset``: 1 for "gptq"
    (v1) checkpoints, 0 for "gptq_v2". Each call checks ``g_idx`` on the host (one synchronisation);
    :class:`GPTQWeight` checks once.
    """
    return _dequantize(*_prepare(qweight, qzeros, scales, g_idx, dtype, zero_offset, bits, "gptq_dequantize"))


def gptq_group_index(in_features: int, group_size: int, device=None) -> torch.Tensor:
    """The plain ``g_idx`` (no act-order): int32 ``i // group_size``, all zeros for ``group_size = -1``."""
    if not _is_int(in_features) or in_features <= 0:
        raise ValueError(f"gptq_group_index: in_features must be a positive int, got {in_features!r}")
    if not _is_int(group_size) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"gptq_group_index: group_size must be a positive int or -1 (one group), got {group_size!r}")
    size = in_features if group_size == -1 else group_size
    return (torch.arange(in_features, device=device) // size).to(torch.int32)


class GPTQWeight:
    """A frozen GPTQ 4-bit ``[out, in]`` weight, which the LoRA ops take in place of a dense weight.

    Built from a checkpoint's tensors (arguments as :func:`gptq_dequantize`; ``dtype`` is the compute dtype
    the weight dequantizes to, default the scales' dtype), validated once here. ``shape``, ``device``,
    ``dtype`` and ``requires_grad`` (always False) mirror a weight tensor's; :meth:`dequantize` returns a
    fresh dense copy. ``group_size`` is the plain group size found in ``g_idx`` (None under act-order).
    """

    __slots__ = ("qweight", "qzeros", "scales", "g_idx", "zero_offset", "_group_size", "shape", "device", "dtype")
    requires_grad = False

    def __init__(
        self,
        qweight: torch.Tensor,
        qzeros: torch.Tensor,
        scales: torch.Tensor,
        g_idx: torch.Tensor,
        dtype: torch.dtype | None = None,
        *,
        zero_offset: int = 1,
        bits: int = 4,
    ):
        if dtype is None and isinstance(scales, torch.Tensor):
            dtype = scales.dtype
        (self.qweight, self.qzeros, self.scales, self.g_idx, self.dtype, self.zero_offset,
         self._group_size) = _prepare(qweight, qzeros, scales, g_idx, dtype, zero_offset, bits, "GPTQWeight")
        self.shape = torch.Size((self.qweight.shape[1], self.qweight.shape[0] * PACK))
        self.device = self.qweight.device

    @property
    def group_size(self) -> int | None:
        return self._group_size or None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new contiguous ``[out, in]`` tensor of ``dtype`` (default: :attr:`dtype`)."""
        dtype = self.dtype if dtype is None else dtype
        if dtype not in OUTPUT_DTYPES:
            raise ValueError(f"GPTQWeight.dequantize: dtype must be one of torch.float32, torch.bfloat16, "
                             f"torch.float16 or None (the weight's {self.dtype}); got {dtype!r}")
        return _dequantize(self.qweight, self.qzeros, self.scales, self.g_idx, dtype, self.zero_offset,
                           self._group_size)

    def __repr__(self) -> str:
        groups = f"group_size={self._group_size}" if self._group_size else "act-order"
        return (f"GPTQWeight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"n_groups={self.scales.shape[0]}, {groups}, zero_offset={self.zero_offset})")


# 6. round-to-nearest quantizer --------------------------------------------------------------------
def _to_int32_words(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same 32 bits."""
    return (words - ((words >> 31) & 1) * (1 << 32)).to(torch.int32)


def _pack_last(values: torch.Tensor) -> torch.Tensor:
    """[..., n, 8] int64 nibbles (lowest first) -> [..., n] int32 words."""
    shifts = torch.arange(0, 32, BITS, device=values.device)
    return _to_int32_words((values << shifts).sum(-1))


def gptq_quantize_rtn(
    weight: torch.Tensor,
    group_size: int = 128,
    *,
    sym: bool = True,
    act_order: bool = False,
    zero_offset: int = 1,
) -> dict[str, torch.Tensor]:
    """Round-to-nearest 4-bit quantization of a ``[out, in]`` weight into the GPTQ format (no calibration).

    Per group of ``group_size`` input channels (-1: one group) and output feature: ``sym``: scale
    ``2 * max|w| / 15``, zero 8; asymmetric: scale ``(max(w, 0) - min(w, 0)) / 15``, zero
    ``round(-min(w, 0) / scale)`` (at least ``zero_offset``: v1 cannot store a zero of 0). The scale is
    rounded to fp16 first and ``q = clamp(round(w / scale) + zero, 0, 15)`` uses that fp16 scale (an
    all-zero group gets scale 1). ``act_order``: channels are grouped in order of descending column norm
    (calibration-free stand-in for GPTQ's Hessian order), ``g_idx`` says where each went; ``qweight`` keeps
    the original order. ``zero_offset``: 1 writes "gptq" v1 (zero - 1 stored), 0 "gptq_v2".
    Returns ``{"qweight", "qzeros", "scales" (fp16), "g_idx" (int32)}`` on the weight's device.
    """
    op = "gptq_quantize_rtn"
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        raise ValueError(f"{op}: weight must be a 2-D floating-point tensor [out_features, in_features], got "
                         + (f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor)
                            else type(weight).__name__))
    out_features, in_features = weight.shape
    if out_features == 0 or in_features == 0 or out_features % PACK or in_features % PACK:
        raise ValueError(f"{op}: weight is {tuple(weight.shape)}; out_features and in_features must be positive "
                         "multiples of 8 (GPTQ packs eight 4-bit values per int32 along both)")
    if not _is_int(group_size) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"{op}: group_size must be a positive int or -1 (one group), got {group_size!r}")
    if not _is_int(zero_offset) or zero_offset not in (0, 1):
        raise ValueError(f"{op}: zero_offset must be 1 (\"gptq\" v1) or 0 (\"gptq_v2\"); got {zero_offset!r}")
    w = weight.detach().float()
    if not torch.isfinite(w).all():
        raise ValueError(f"{op}: weight has non-finite values (inf or NaN); they cannot be quantized")
    size = in_features if group_size == -1 else min(group_size, in_features)
    n_groups = -(-in_features // size)
    device = w.device
    rank = torch.arange(in_features, device=device)
    if act_order:
        order = torch.argsort(torch.linalg.vector_norm(w, dim=0), descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(in_features, device=device))
    g = rank // size  # [in]
    wt = w.t()  # [in, out]
    index = g[:, None].expand(in_features, out_features)
    lo = torch.zeros(n_groups, out_features, device=device).scatter_reduce(0, index, wt, "amin")  # min(w, 0)
    hi = torch.zeros(n_groups, out_features, device=device).scatter_reduce(0, index, wt, "amax")  # max(w, 0)
    scale = (torch.maximum(-lo, hi) * (2 / 15)) if sym else (hi - lo) / 15
    if bool((scale > torch.finfo(torch.float16).max).any()):
        raise ValueError(f"{op}: the weight's range ({float(scale.max()) * 15:.3g}) is too large for fp16 scales")
    scale = scale.to(torch.float16)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    s = scale.float()
    if sym:
        zero = torch.full_like(s, 8.0)
    else:
        zero = torch.round(-lo / s).clamp(zero_offset, 15)
    q = torch.clamp(torch.round(wt / s[g]) + zero[g], 0, 15).long()  # [in, out]
    qweight = _pack_last(q.reshape(in_features // PACK, PACK, out_features).transpose(1, 2))
    stored = (zero.long() - zero_offset).reshape(n_groups, out_features // PACK, PACK)
    return {"qweight": qweight.contiguous(), "qzeros": _pack_last(stored).contiguous(), "scales": scale.contiguous(),
            "g_idx": g.to(torch.int32)}


def gptq_error_report(weight: torch.Tensor, packed: dict, *, zero_offset: int = 1) -> float:
    """Relative error ``||W - dequant(packed)||_F / ||W||_F`` (fp32) of a packed weight (the dict of
    :func:`gptq_quantize_rtn` or a checkpoint's four tensors) against the dense ``weight`` [out, in];
    ``zero_offset`` as the packed weight was written. Calibration-free: no activations involved."""
    op = "gptq_error_report"
    missing = [k for k in ("qweight", "qzeros", "scales", "g_idx") if k not in packed]
    if missing:
        raise ValueError(f"{op}: packed lacks {missing}; pass the dict of gptq_quantize_rtn")
    deq = gptq_dequantize(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"],
                          dtype=torch.float32, zero_offset=zero_offset)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != tuple(deq.shape):
        raise ValueError(f"{op}: weight must be a tensor of the packed weight's shape {tuple(deq.shape)}, got "
                         + (str(tuple(weight.shape)) if isinstance(weight, torch.Tensor) else type(weight).__name__))
    w = weight.detach().to(device=deq.device, dtype=torch.float32)
    err, norm = torch.stack((torch.linalg.vector_norm(deq - w), torch.linalg.vector_norm(w))).tolist()
    if norm == 0:
        return 0.0 if err == 0 else float("inf")
    return err / norm
