"""foak.ops.nf4 against bitsandbytes' own NF4 dequantization (bitsandbytes 0.50.2 on CPU), in the Triton
interpreter: bit-exact (torch.equal), with and without double-quantized absmax."""

import pytest
import torch
from bitsandbytes import functional as bnbf

import foak
from foak.ops import nf4 as nf4_mod
from foak.ops.nf4 import NF4Weight, nf4_dequantize, nf4_dequantize_reference

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.fixture
def auto_backend():
    yield
    foak.set_backend("auto")


def _quantized(shape, dtype, nested, blocksize=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    packed, qs = bnbf.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")
    assert packed.shape[0] > 1  # bitsandbytes transposes its output for a [1, n] packed tensor
    return packed, qs


def _raw(qs):
    """The raw tensors of a QuantState, as the patching layer passes them."""
    kw = {"code": qs.code, "blocksize": qs.blocksize}
    if qs.nested:
        kw.update(nested_absmax=qs.state2.absmax, nested_code=qs.state2.code,
                  nested_blocksize=qs.state2.blocksize, offset=qs.offset)
    return qs.absmax, qs.shape, qs.dtype, kw


# 37x130: 4810 elements, neither a multiple of 64 nor of a program's 2048 outputs (3 programs);
# 129x160: 323 blocks, 11 programs, two nested blocks of 256 (the second partial)
@pytest.mark.parametrize("shape", [(37, 130), (129, 160)])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_bitsandbytes(shape, nested, dtype):
    packed, qs = _quantized(shape, dtype, nested)
    assert (qs.absmax.dtype == torch.uint8) == nested
    expected = bnbf.dequantize_4bit(packed, qs, quant_type="nf4")
    absmax, shp, dt, kw = _raw(qs)
    out = nf4_dequantize(packed, absmax, shp, dt, **kw)
    assert out.shape == shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, expected)
    assert torch.equal(nf4_dequantize_reference(packed, absmax, shp, dt, **kw), expected)
    # not a trivial pass: the values are spread over the 16 levels and the block scales
    assert expected.unique().numel() > 100


def test_odd_element_count_matches_bitsandbytes():
    # 35 elements: the last byte's low nibble is padding (bitsandbytes' odd-width path compiles once, ~2 s)
    packed, qs = _quantized((5, 7), torch.bfloat16, nested=True)
    absmax, shp, dt, kw = _raw(qs)
    expected = bnbf.dequantize_4bit(packed, qs, quant_type="nf4")
    assert torch.equal(nf4_dequantize(packed, absmax, shp, dt, **kw), expected)
    assert torch.equal(nf4_dequantize_reference(packed, absmax, shp, dt, **kw), expected)


@pytest.mark.parametrize("blocksize", [32, 4096])  # 4096: one block is wider than a program's default tile
def test_other_blocksizes(blocksize):
    packed, qs = _quantized((37, 260), torch.bfloat16, nested=True, blocksize=blocksize)
    absmax, shp, dt, kw = _raw(qs)
    expected = bnbf.dequantize_4bit(packed, qs, quant_type="nf4")
    assert torch.equal(nf4_dequantize(packed, absmax, shp, dt, **kw), expected)


def test_absmax_in_torch_variant(monkeypatch):
    monkeypatch.setitem(nf4_mod.TUNING, "absmax", "torch")
    monkeypatch.setitem(nf4_mod.TUNING, "bytes_per_program", 256)  # 8 blocks per program
    packed, qs = _quantized((129, 160), torch.bfloat16, nested=True)
    absmax, shp, dt, kw = _raw(qs)
    expected = bnbf.dequantize_4bit(packed, qs, quant_type="nf4")
    assert torch.equal(nf4_dequantize(packed, absmax, shp, dt, **kw), expected)


def test_scales_round_twice_not_fused():
    # the nested scale is (code2[q] * absmax2) rounded, then + offset rounded; a fused multiply-add would
    # differ in some blocks of this weight, so the bit-exact comparison above can tell the two apart
    _, qs = _quantized((129, 160), torch.float32, nested=True)
    c = qs.state2.code[qs.absmax.long()]
    a = qs.state2.absmax[torch.arange(qs.absmax.numel()) // 256]
    fused = (c.double() * a.double() + qs.offset.double()).float()
    assert ((c * a + qs.offset) != fused).any()


def test_reference_backend(auto_backend):
    packed, qs = _quantized((37, 130), torch.float16, nested=True)
    absmax, shp, dt, kw = _raw(qs)
    foak.set_backend("reference")
    expected = bnbf.dequantize_4bit(packed, qs, quant_type="nf4")
    assert torch.equal(nf4_dequantize(packed, absmax, shp, dt, **kw), expected)


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_nf4_weight(nested):
    packed, qs = _quantized((37, 130), torch.bfloat16, nested)
    absmax, shp, dt, kw = _raw(qs)
    if nested:
        kw["offset"] = float(qs.offset)  # a float offset works as well as the tensor
    weight = NF4Weight(packed.reshape(-1), absmax, shp, dt, **kw)
    assert weight.shape == torch.Size([37, 130]) and isinstance(weight.shape, torch.Size)
    assert weight.device == torch.device("cpu") and weight.dtype == torch.bfloat16
    assert weight.requires_grad is False
    a, b = weight.dequantize(), weight.dequantize()
    assert a.dtype == torch.bfloat16 and a.shape == (37, 130) and a.is_contiguous()
    assert a.data_ptr() != b.data_ptr()  # a fresh tensor each call
    assert torch.equal(a, bnbf.dequantize_4bit(packed, qs, quant_type="nf4"))
    full = weight.dequantize(torch.float32)
    qs.dtype = torch.float32  # bitsandbytes' fp32 dequantization of the same state: the unrounded products
    assert torch.equal(full, bnbf.dequantize_4bit(packed, qs, quant_type="nf4"))
    assert torch.equal(full.to(torch.bfloat16), a)
    assert "NF4Weight" in repr(weight)
    with pytest.raises(ValueError, match="dtype must be one of"):
        weight.dequantize(torch.float64)


def test_errors():
    packed, qs = _quantized((37, 130), torch.bfloat16, nested=True)
    absmax, shp, dt, kw = _raw(qs)
    plain_packed, plain_qs = _quantized((37, 130), torch.bfloat16, nested=False)
    plain = {"code": plain_qs.code}

    def raises(match, *args, **kwargs):
        with pytest.raises(ValueError, match=match):
            nf4_dequantize(*args, **kwargs)

    raises(r"packed.view\(torch.uint8\)", packed.view(torch.int8), absmax, shp, dt, **kw)
    raises("packs two elements per byte", packed[:-1], absmax, shp, dt, **kw)
    raises("packs two elements per byte", packed, absmax, (37, 132), dt, **kw)
    raises("blocks", packed, absmax[:-1], shp, dt, **kw)
    raises("nested_absmax, nested_code, offset are missing", packed, absmax, shp, dt, code=qs.code)
    raises("offset is missing", packed, absmax, shp, dt, **{**kw, "offset": None})
    raises("nested_absmax given but absmax is fp32", plain_packed, plain_qs.absmax, shp, dt,
           nested_absmax=qs.state2.absmax, **plain)
    raises("absmax has dtype torch.float16", plain_packed, plain_qs.absmax.half(), shp, dt, **plain)
    raises("nested_absmax has 2 elements; expected 1", packed, absmax, shp, dt,
           **{**kw, "nested_absmax": torch.ones(2)})
    raises("nested_code has dtype torch.float16", packed, absmax, shp, dt,
           **{**kw, "nested_code": qs.state2.code.half()})
    raises("code has 8 elements; expected 16", plain_packed, plain_qs.absmax, shp, dt, code=plain_qs.code[:8])
    raises("dtype must be one of", plain_packed, plain_qs.absmax, shp, torch.float64, **plain)
    raises("blocksize must be one of", plain_packed, plain_qs.absmax, shp, dt, code=plain_qs.code, blocksize=48)
    raises("shape must be a sequence", plain_packed, plain_qs.absmax, 4810, dt, **plain)
    raises("code must be a torch.Tensor", plain_packed, plain_qs.absmax, shp, dt, code=[0.0] * 16)
    with pytest.raises(ValueError, match="shape must be 2-D"):
        NF4Weight(plain_packed, plain_qs.absmax, (37, 10, 13), dt, **plain)


def test_fake_op():
    # the meta implementation torch.compile traces with: shape and dtype without running the kernel
    from torch._subclasses.fake_tensor import FakeTensorMode

    packed, qs = _quantized((37, 130), torch.bfloat16, nested=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = nf4_mod._dequantize_op.custom_op(packed.reshape(-1), qs.absmax, [37, 130], torch.float16, qs.code,
                                               64, None, None, 256, None)
    assert out.shape == (37, 130) and out.dtype == torch.float16
