"""foak.ops.gptq in the Triton interpreter: the kernel bit-exact with the torch reference, and both with an
independent numpy implementation of the format (its own packer and unpacker, a hand-built v1 checkpoint);
the round-to-nearest quantizer's format and error; GPTQWeight as a LoRA base; the errors."""

import numpy as np
import pytest
import torch

import foak
from foak.ops import gptq as gptq_mod
from foak.ops.gptq import (
    GPTQWeight,
    gptq_dequantize,
    gptq_dequantize_reference,
    gptq_error_report,
    gptq_group_index,
    gptq_quantize_rtn,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# an independent implementation of the format (numpy, uint32 words, loops over channels) ------------
def np_pack_rows(q):
    """[in, out] nibbles -> [in // 8, out] int32: q[i, j] at bits 4 * (i % 8) of word [i // 8, j]."""
    q = np.asarray(q, dtype=np.uint32)
    words = np.zeros((q.shape[0] // 8, q.shape[1]), dtype=np.uint32)
    for i in range(q.shape[0]):
        words[i // 8] |= q[i] << np.uint32(4 * (i % 8))
    return torch.from_numpy(words.view(np.int32).copy())


def np_pack_cols(z):
    """[groups, out] nibbles -> [groups, out // 8] int32: z[g, j] at bits 4 * (j % 8) of word [g, j // 8]."""
    z = np.asarray(z, dtype=np.uint32)
    words = np.zeros((z.shape[0], z.shape[1] // 8), dtype=np.uint32)
    for j in range(z.shape[1]):
        words[:, j // 8] |= z[:, j] << np.uint32(4 * (j % 8))
    return torch.from_numpy(words.view(np.int32).copy())


def np_dequantize(qweight, qzeros, scales, g_idx, zero_offset, nibble_of=lambda i: i % 8):
    """fp64 W [out, in] = scale * (q - zero), read from the packed words one input channel at a time."""
    words = qweight.numpy().view(np.uint32)
    zwords = qzeros.numpy().view(np.uint32)
    s = scales.double().numpy()
    out_f, in_f = words.shape[1], words.shape[0] * 8
    cols = np.arange(out_f)
    w = np.zeros((out_f, in_f))
    for i in range(in_f):
        g = int(g_idx[i])
        q = (words[i // 8] >> np.uint32(4 * nibble_of(i))) & 15
        zero = ((zwords[g, cols // 8] >> (4 * (cols % 8)).astype(np.uint32)) & 15) + zero_offset
        w[:, i] = s[g] * (q.astype(np.int64) - zero.astype(np.int64))
    return torch.from_numpy(w)


def np_levels(ckpt, zero_offset):
    """q - zero (fp64 integers) of a packed weight: np_dequantize with unit scales."""
    return np_dequantize(ckpt["qweight"], ckpt["qzeros"], torch.ones_like(ckpt["scales"]), ckpt["g_idx"],
                         zero_offset)


def random_checkpoint(out_f, in_f, group_size, *, sym, act_order, zero_offset=1, scale_dtype=torch.float16,
                      seed=0):
    """Random nibbles, zeros and scales packed by the numpy packer (not by foak's quantizer)."""
    rng = np.random.default_rng(seed)
    size = in_f if group_size == -1 else group_size
    n_groups = -(-in_f // size)
    rank = rng.permutation(in_f) if act_order else np.arange(in_f)
    g_idx = torch.from_numpy((rank // size).astype(np.int32))
    q = rng.integers(0, 16, size=(in_f, out_f))
    zeros = np.full((n_groups, out_f), 8) if sym else rng.integers(zero_offset, 16, size=(n_groups, out_f))
    scales = torch.from_numpy(rng.uniform(0.001, 0.05, size=(n_groups, out_f))).to(scale_dtype)
    return {"qweight": np_pack_rows(q), "qzeros": np_pack_cols(zeros - zero_offset), "scales": scales,
            "g_idx": g_idx}


def check_all_dtypes(ckpt, zero_offset=1, min_unique=100):
    expected = np_dequantize(**ckpt, zero_offset=zero_offset)
    assert expected.unique().numel() >= min_unique  # spread over nibbles, zeros and scales
    for dtype in DTYPES:
        out = gptq_dequantize(**ckpt, dtype=dtype, zero_offset=zero_offset)
        ref = gptq_dequantize_reference(**ckpt, dtype=dtype, zero_offset=zero_offset)
        assert out.dtype == dtype and out.is_contiguous() and out.shape == expected.shape
        assert torch.equal(out, ref), (dtype, (out != ref).sum())
        assert torch.equal(out, expected.to(dtype)), dtype  # the exact value, rounded once


@pytest.fixture
def auto_backend():
    yield
    foak.set_backend("auto")


# 1. the format --------------------------------------------------------------------------------------
def test_hand_built_v1_checkpoint():
    # 16 outputs x 24 inputs, group 8 (3 groups), asymmetric zeros 1..16 written as v1 (zero - 1 stored)
    out_f, in_f = 16, 24
    q = [[(3 * i + 5 * j) % 16 for j in range(out_f)] for i in range(in_f)]
    zeros = [[1 + (g * 7 + j) % 16 for j in range(out_f)] for g in range(3)]  # 1..16 (16 stored as 15)
    scales = [[0.25 * (1 + (g + j) % 5) for j in range(out_f)] for g in range(3)]
    expected = torch.tensor([[scales[i // 8][j] * (q[i][j] - zeros[i // 8][j]) for i in range(in_f)]
                             for j in range(out_f)], dtype=torch.float64)
    # pack by hand: plain Python ints, then two's complement into int32
    def word(nibbles):
        v = sum(n << (4 * k) for k, n in enumerate(nibbles))
        return v - (1 << 32) if v >= 1 << 31 else v

    qweight = torch.tensor([[word([q[8 * r + k][j] for k in range(8)]) for j in range(out_f)]
                            for r in range(in_f // 8)], dtype=torch.int32)
    qzeros = torch.tensor([[word([zeros[g][8 * c + k] - 1 for k in range(8)]) for c in range(out_f // 8)]
                           for g in range(3)], dtype=torch.int32)
    assert (qweight < 0).any() and (qzeros < 0).any()  # top nibbles >= 8: the sign bit is set
    ckpt = {"qweight": qweight, "qzeros": qzeros, "scales": torch.tensor(scales, dtype=torch.float16),
            "g_idx": gptq_group_index(in_f, 8)}
    assert torch.equal(np_dequantize(**ckpt, zero_offset=1), expected)
    for dtype in DTYPES:
        assert torch.equal(gptq_dequantize(**ckpt, dtype=dtype), expected.to(dtype))  # zero_offset=1 default
        assert torch.equal(gptq_dequantize_reference(**ckpt, dtype=dtype), expected.to(dtype))
    assert torch.equal(GPTQWeight(**ckpt).dequantize(torch.float32), expected.float())
    # the same words read as v2 are off by one scale: the offset matters
    v2 = gptq_dequantize(**ckpt, dtype=torch.float32, zero_offset=0)
    assert torch.equal(v2 - expected.float(), torch.tensor(scales)[torch.arange(in_f) // 8].t().float())


CASES = {  # name: (out, in, group_size, sym, act_order)
    "sym-g32": (40, 136, 32, True, False),  # 5 groups, the last of 8 channels
    "asym-g32": (40, 136, 32, False, False),
    "sym-g32-act": (40, 136, 32, True, True),
    "asym-g32-act": (40, 136, 32, False, True),
    "asym-g-1": (40, 136, -1, False, False),
    "sym-g-1-act": (40, 136, -1, True, True),
    "asym-g128-big": (72, 264, 128, False, False),  # 3 x 3 tiles of 64 x 128, partial at both edges
    "asym-g64-big-act": (72, 264, 64, False, True),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_independent(case):
    out_f, in_f, group_size, sym, act_order = CASES[case]
    check_all_dtypes(random_checkpoint(out_f, in_f, group_size, sym=sym, act_order=act_order, seed=len(case)))


@pytest.mark.parametrize("zero_offset", [0, 1], ids=["v2", "v1"])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "act"])
def test_v2_and_other_scale_dtypes(zero_offset, scale_dtype, act_order):
    # group 128 on 264 inputs: without act-order each 128-wide tile reads one scale per row
    ckpt = random_checkpoint(40, 264, 128, sym=False, act_order=act_order, zero_offset=zero_offset,
                             scale_dtype=scale_dtype)
    assert GPTQWeight(**ckpt).group_size == (None if act_order else 128)
    if scale_dtype == torch.float32:  # fp32 scales: one fp32 product (not exact), the same in torch and Triton
        expected = (ckpt["scales"][ckpt["g_idx"].long()] * np_levels(ckpt, zero_offset).t().float()).t()
        for dtype in DTYPES:
            out = gptq_dequantize(**ckpt, dtype=dtype, zero_offset=zero_offset)
            assert torch.equal(out, gptq_dequantize_reference(**ckpt, dtype=dtype, zero_offset=zero_offset))
            assert torch.equal(out, expected.to(dtype))
    else:
        check_all_dtypes(ckpt, zero_offset)


@pytest.mark.parametrize("unpack", ["reshape", "gather"])
@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "act"])
def test_small_tiles(monkeypatch, unpack, act_order):
    # 16 x 32 tiles: 3 x 5 programs on 40 x 136, partial tiles at both edges; group 32 takes the one-group-
    # per-tile path without act-order, the gathers with it
    for prefix in ("", "act_order_"):
        monkeypatch.setitem(gptq_mod.TUNING, prefix + "block_out", 16)
        monkeypatch.setitem(gptq_mod.TUNING, prefix + "block_in", 32)
    monkeypatch.setitem(gptq_mod.TUNING, "act_order_layout", "out_major")
    monkeypatch.setitem(gptq_mod.TUNING, "unpack", unpack)
    ckpt = random_checkpoint(40, 136, 32, sym=False, act_order=act_order, seed=3)
    assert GPTQWeight(**ckpt).group_size == (None if act_order else 32)
    check_all_dtypes(ckpt)


@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "act"])
def test_in_major_layout(monkeypatch, act_order):
    # the [in, out]-ordered tile kernel: the same bits, partial tiles at both edges
    for prefix in ("", "act_order_"):
        monkeypatch.setitem(gptq_mod.TUNING, prefix + "block_out", 16)
        monkeypatch.setitem(gptq_mod.TUNING, prefix + "block_in", 32)
    monkeypatch.setitem(gptq_mod.TUNING, "layout", "in_major")
    monkeypatch.setitem(gptq_mod.TUNING, "act_order_layout", "in_major")
    check_all_dtypes(random_checkpoint(40, 136, 32, sym=False, act_order=act_order, seed=6))


def test_gather_unpack_default_tiles(monkeypatch):
    monkeypatch.setitem(gptq_mod.TUNING, "unpack", "gather")
    check_all_dtypes(random_checkpoint(72, 264, 128, sym=True, act_order=False, seed=4), min_unique=50)


def test_reference_backend(auto_backend):
    ckpt = random_checkpoint(40, 136, 32, sym=False, act_order=True, seed=5)
    foak.set_backend("reference")
    expected = np_dequantize(**ckpt, zero_offset=1)
    assert torch.equal(gptq_dequantize(**ckpt, dtype=torch.bfloat16), expected.to(torch.bfloat16))
    assert torch.equal(GPTQWeight(**ckpt).dequantize(), expected.to(torch.float16))


# 2. the quantizer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_quantize_round_trip(group_size, sym):
    gen = torch.Generator().manual_seed(group_size + 2 * sym)
    w = torch.randn(48, 256, generator=gen).to(torch.bfloat16)
    packed = gptq_quantize_rtn(w, group_size, sym=sym)
    size = 256 if group_size == -1 else group_size
    n_groups = 256 // size
    assert packed["qweight"].dtype == torch.int32 and packed["qweight"].shape == (32, 48)
    assert packed["qzeros"].dtype == torch.int32 and packed["qzeros"].shape == (n_groups, 6)
    assert packed["scales"].dtype == torch.float16 and packed["scales"].shape == (n_groups, 48)
    assert packed["g_idx"].dtype == torch.int32 and torch.equal(packed["g_idx"], gptq_group_index(256, group_size))
    levels = np_levels(packed, 1)  # q - zero
    if sym:  # zero 8 everywhere, stored 7 (v1): levels -8..7
        assert torch.equal(packed["qzeros"], torch.full_like(packed["qzeros"], 0x77777777))
        assert levels.min() == -8 and levels.max() == 7
    else:
        assert levels.min() >= -15 and levels.max() <= 15 and levels.unique().numel() >= 16
    deq = gptq_dequantize(**packed, dtype=torch.float32)
    assert torch.equal(deq, np_dequantize(**packed, zero_offset=1).float())
    # round to nearest: each element within half a step (plus the fp16 rounding of the scale) of the weight
    step = packed["scales"].float()[packed["g_idx"].long()].t()
    assert ((deq - w.float()).abs() <= 0.5 * step * 1.01).all()
    error = gptq_error_report(w, packed)
    assert error == pytest.approx(((deq - w.float()).norm() / w.float().norm()).item(), rel=1e-5)
    bound = {32: 0.105, 128: 0.125, -1: 0.135}[group_size]  # 4-bit RTN of Gaussian rows (measured 0.08-0.12)
    assert 0.05 < error < bound
    # a wrong unpacking (nibbles read high first) is far off: the bound can tell
    wrong = np_dequantize(**packed, zero_offset=1, nibble_of=lambda i: 7 - i % 8).float()
    assert ((wrong - w.float()).norm() / w.float().norm()).item() > 5 * bound


@pytest.mark.parametrize("group_size", [32, -1])
def test_quantize_act_order(group_size):
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(48, 256, generator=gen) * (0.25 + torch.rand(256, generator=gen))  # columns of unequal norm
    packed = gptq_quantize_rtn(w, group_size, sym=False, act_order=True)
    size = 256 if group_size == -1 else group_size
    order = torch.argsort(w.norm(dim=0), descending=True, stable=True)
    assert packed["g_idx"].dtype == torch.int32
    assert torch.equal(packed["g_idx"][order].long(), torch.arange(256) // size)  # k-th largest norm: group k // size
    deq = gptq_dequantize(**packed, dtype=torch.float32)
    assert torch.equal(deq, np_dequantize(**packed, zero_offset=1).float())
    step = packed["scales"].float()[packed["g_idx"].long()].t()
    assert ((deq - w).abs() <= 0.5 * step * 1.01).all()
    plain = gptq_quantize_rtn(w, group_size, sym=False)
    if group_size == -1:  # one group: the order changes nothing
        assert torch.equal(packed["qweight"], plain["qweight"]) and torch.equal(packed["g_idx"], plain["g_idx"])
    else:  # channels of similar norm share a scale: a smaller error than consecutive groups
        assert not torch.equal(packed["g_idx"], plain["g_idx"])
        assert gptq_error_report(w, packed) < 0.95 * gptq_error_report(w, plain)


def test_quantize_v2_and_edge_groups():
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(16, 136, generator=gen)
    w[:, 8:16] = 0.0  # an all-zero group (scale 1, every q the zero)
    w[:3, 16:24] = torch.rand(3, 8, generator=gen)  # non-negative groups: asym v1 clamps the zero to 1
    v1 = gptq_quantize_rtn(w, 8, sym=False)
    v2 = gptq_quantize_rtn(w, 8, sym=False, zero_offset=0)
    assert torch.equal(v1["scales"], v2["scales"])
    assert not torch.equal(v1["qzeros"], v2["qzeros"])
    z1, z2 = -np_levels({**v1, "qweight": torch.zeros_like(v1["qweight"])}, 1), \
        -np_levels({**v2, "qweight": torch.zeros_like(v2["qweight"])}, 0)  # the zeros, per element
    assert z1.min() >= 1 and z2[:3, 16:24].eq(0).all() and z1[:3, 16:24].eq(1).all()
    d1 = gptq_dequantize(**v1, dtype=torch.float32)
    d2 = gptq_dequantize(**v2, dtype=torch.float32, zero_offset=0)
    same = z1 == z2
    assert same.float().mean() > 0.9 and torch.equal(d1[same], d2[same])
    assert torch.equal(d2[:, 8:16], torch.zeros(16, 8)) and torch.equal(d1[:, 8:16], torch.zeros(16, 8))
    assert torch.equal(v1["scales"][1], torch.ones(16, dtype=torch.float16))
    assert gptq_error_report(w, v2, zero_offset=0) < gptq_error_report(w, v1) < 0.1
    # group 128 of 136 channels: two groups, the second of 8
    g = gptq_quantize_rtn(w, 128)
    assert g["scales"].shape == (2, 16) and torch.equal(g["g_idx"], gptq_group_index(136, 128))
    # a group larger than the layer: one group
    assert torch.equal(gptq_quantize_rtn(w, 512)["qzeros"], gptq_quantize_rtn(w, -1)["qzeros"])


# 3. GPTQWeight ---------------------------------------------------------------------------------------
def test_gptq_weight():
    ckpt = random_checkpoint(40, 136, 32, sym=False, act_order=True, seed=6)
    ckpt["g_idx"] = ckpt["g_idx"].long()  # int64 g_idx works too
    weight = GPTQWeight(**ckpt, dtype=torch.bfloat16)
    assert weight.shape == torch.Size([40, 136]) and isinstance(weight.shape, torch.Size)
    assert weight.device == torch.device("cpu") and weight.dtype == torch.bfloat16
    assert weight.requires_grad is False and weight.group_size is None
    a, b = weight.dequantize(), weight.dequantize()
    assert a.dtype == torch.bfloat16 and a.shape == (40, 136) and a.is_contiguous()
    assert a.data_ptr() != b.data_ptr()
    assert torch.equal(a, gptq_dequantize(**ckpt, dtype=torch.bfloat16))
    assert torch.equal(weight.dequantize(torch.float32), gptq_dequantize(**ckpt, dtype=torch.float32))
    assert GPTQWeight(**ckpt).dtype == torch.float16  # default: the scales' dtype
    assert "GPTQWeight" in repr(weight) and "act-order" in repr(weight)
    with pytest.raises(ValueError, match="dtype must be one of"):
        weight.dequantize(torch.float64)


def test_lora_linear_with_gptq_weight():
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(40, 136, generator=gen)
    packed = gptq_quantize_rtn(w, 32, sym=False, act_order=True)
    weight = GPTQWeight(**packed, dtype=torch.float32)
    dense = gptq_dequantize(**packed, dtype=torch.float32)
    a, b = torch.randn(4, 136, generator=gen) * 0.1, torch.randn(40, 4, generator=gen) * 0.1
    x = torch.randn(2, 3, 136, generator=gen)
    dy = torch.randn(2, 3, 40, generator=gen)
    outs = []
    for base in (weight, dense):
        xl, al, bl = (t.clone().requires_grad_() for t in (x, a, b))
        out = foak.lora_linear(xl, base, None, al, bl, 2.0)
        outs.append((out, *torch.autograd.grad(out, (xl, al, bl), dy)))
    for ours, ref in zip(*outs):
        assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-6)
    # and the dense base is the quantized weight, not the original
    assert not torch.allclose(outs[1][0], foak.lora_linear(x, w, None, a, b, 2.0), atol=1e-3)


# 4. errors ---------------------------------------------------------------------------------------------
def test_errors():
    ckpt = random_checkpoint(40, 136, 32, sym=True, act_order=False)
    qw, qz, sc, gi = ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"]

    def raises(match, *args, dtype=torch.float16, **kwargs):
        with pytest.raises(ValueError, match=match):
            gptq_dequantize(*args, dtype=dtype, **kwargs)

    raises("bits=3 is not supported", qw, qz, sc, gi, bits=3)
    raises("bits=8 is not supported", qw, qz, sc, gi, bits=8)
    raises("zero_offset must be 1", qw, qz, sc, gi, zero_offset=2)
    raises("dtype must be one of", qw, qz, sc, gi, dtype=torch.float64)
    raises(r"qweight has dtype torch.int64; expected torch.int32", qw.long(), qz, sc, gi)
    raises("qweight must be 2-D", qw.reshape(-1), qz, sc, gi)
    raises("out_features .* is 36; it must be a multiple of 8", qw[:, :36], qz, sc, gi)
    raises("g_idx has 130 entries .* in_features must be a multiple of 8", qw, qz, sc, gi[:130])
    raises("g_idx has 128 entries .* 136 input channels", qw, qz, sc, gi[:128])
    raises("g_idx has dtype torch.float32", qw, qz, sc, gi.float())
    raises("scales has dtype torch.int32", qw, qz, sc.int(), gi)
    raises(r"scales must be \[n_groups >= 1, out_features=40\]", qw, qz, sc[:, :32], gi)
    raises(r"qzeros must be \[n_groups, out_features // 8\] = \[5, 5\]", qw, qz[:4], sc, gi)
    raises(r"qzeros has dtype torch.int64", qw, qz.long(), sc, gi)
    raises("g_idx holds groups 0..4 but scales and qzeros have 4 groups", qw, qz[:4], sc[:4], gi)
    raises("each g_idx entry must be in 0..4", qw, qz, sc, gi - 1)
    raises("qzeros must be a torch.Tensor", qw, qz.tolist(), sc, gi)
    raises("must not be empty", qw[:0], qz, sc, gi[:0])
    with pytest.raises(ValueError, match="bits=2 is not supported"):
        GPTQWeight(qw, qz, sc, gi, bits=2)
    w = torch.randn(40, 136)
    with pytest.raises(ValueError, match="group_size must be a positive int or -1"):
        gptq_quantize_rtn(w, 0)
    with pytest.raises(ValueError, match="multiples of 8"):
        gptq_quantize_rtn(w[:, :130])
    with pytest.raises(ValueError, match="2-D floating-point"):
        gptq_quantize_rtn(w.int())
    with pytest.raises(ValueError, match="non-finite"):
        gptq_quantize_rtn(torch.where(w > 2, float("nan"), w))
    with pytest.raises(ValueError, match="zero_offset must be 1"):
        gptq_quantize_rtn(w, zero_offset=-1)
    with pytest.raises(ValueError, match="packed lacks"):
        gptq_error_report(w, {"qweight": qw})
    with pytest.raises(ValueError, match="group_size must be"):
        gptq_group_index(136, 0)
