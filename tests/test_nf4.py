"""foak.ops.nf4 in the Triton interpreter against the NF4 format's definition, bit-exact (torch.equal), with and
without double-quantized absmax. The expectation is the formula written here (each element: the NF4 level of its
nibble times its block's fp32 scale, one rounding to the dtype; double-quantized scales decoded by the formula
too), never bitsandbytes' dequantization. The inputs come from bitsandbytes' CPU quantize_4bit, itself checked
against the format; its CPU dequantize_4bit is compared with the formula where foak.patching.bnb_cpu finds it
right on this machine (bitsandbytes 0.50.2 is wrong on AVX-512 CPUs; that comparison is skipped there, saying
so)."""

import math

import pytest
import torch
from bitsandbytes import functional as bnbf

import foak
from foak.ops import nf4 as nf4_mod
from foak.ops.nf4 import NF4_LEVELS, NF4Weight, nf4_dequantize, nf4_dequantize_reference
from foak.patching.bnb_cpu import dequant_problem

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LEVELS = torch.tensor(NF4_LEVELS)


@pytest.fixture
def auto_backend():
    yield
    foak.set_backend("auto")


def _weight(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def _quantized(shape, dtype, nested, blocksize=64, seed=0):
    w = _weight(shape, dtype, seed)
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


def _scales(qs):
    """Each block's fp32 scale: absmax, or double-quantized: code2[q] * absmax2[block // 256] (rounded to fp32),
    then + offset (rounded again)."""
    if not qs.nested:
        return qs.absmax
    q = qs.absmax.long()
    return qs.state2.code[q] * qs.state2.absmax[torch.arange(q.numel()) // qs.state2.blocksize] + qs.offset


def _nibbles(packed, n):
    """Element 2i is byte i's high nibble, element 2i + 1 its low one."""
    b = packed.view(torch.uint8).reshape(-1).long()
    nibbles = torch.empty(2 * b.numel(), dtype=torch.long)
    nibbles[0::2], nibbles[1::2] = b // 16, b % 16
    return nibbles[:n]


def formula(packed, qs, dtype=None):
    """The NF4 weight of (packed, QuantState) from the format's definition, in ``dtype`` (default: qs.dtype)."""
    n = math.prod(qs.shape)
    scale = _scales(qs).repeat_interleave(qs.blocksize)[:n]
    return (LEVELS[_nibbles(packed, n)] * scale).to(dtype or qs.dtype).reshape(qs.shape)


def test_code_is_the_nf4_levels():
    _, qs = _quantized((37, 130), torch.float32, nested=False)
    assert torch.equal(qs.code, LEVELS)


def _nearest(values, table, chosen, slack):
    """Every chosen table entry is the nearest to its value, up to ``slack``."""
    dist = (values[:, None] - table[None, :]).abs()
    excess = dist.gather(1, chosen[:, None])[:, 0] - dist.amin(1)
    assert excess.max().item() <= slack, excess.max().item()


@pytest.mark.parametrize("shape,dtype,nested", [((37, 130), torch.bfloat16, True), ((129, 160), torch.float32, True),
                                                ((129, 160), torch.float16, False)], ids=str)
def test_bitsandbytes_quantize_follows_the_format(shape, dtype, nested):
    """bitsandbytes' CPU quantize_4bit (the tests' inputs) against the format: each block's absmax is its largest
    |w|, each nibble (high one first) the NF4 level nearest to w / absmax; double-quantized: offset the mean
    absmax, one absmax2 per 256 blocks (the largest |absmax - offset|), each uint8 the 8-bit code nearest to
    (absmax - offset) / absmax2."""
    w = _weight(shape, dtype)
    packed, qs = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")
    n, blocks = w.numel(), -(-w.numel() // 64)
    flat = w.float().reshape(-1)
    absmax = torch.nn.functional.pad(flat.abs(), (0, blocks * 64 - n)).reshape(blocks, 64).amax(1)
    _nearest(flat / absmax.repeat_interleave(64)[:n], LEVELS, _nibbles(packed, n), 1e-6)
    if not nested:
        assert torch.equal(qs.absmax, absmax)
        return
    assert torch.allclose(qs.offset, absmax.mean(), rtol=1e-6, atol=0)
    centred = absmax - qs.offset
    assert torch.allclose(qs.state2.absmax, torch.stack([c.abs().max() for c in centred.split(256)]), rtol=1e-6)
    group = torch.arange(blocks) // 256
    # (bitsandbytes searches a 65536-bin table of [-1, 1]: nearest up to one bin)
    _nearest(centred / qs.state2.absmax[group], qs.state2.code, qs.absmax.long(), 2 / 65535)
    assert (_scales(qs) - absmax).abs().max() <= 0.02 * absmax.max()  # and decodes close to the true absmax


# 37x130: 4810 elements# 37x130: 4810 elements, neither a multiple of 64 nor of a program's 2048 outputs (3 programs);
# 129x160: 323 blocks, 11 programs, two nested blocks of 256 (the second partial)
@pytest.mark.parametrize("shape", [(37, 130), (129, 160)])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_the_formula(shape, nested, dtype):
    packed, qs = _quantized(shape, dtype, nested)
    assert (qs.absmax.dtype == torch.uint8) == nested
    expected = formula(packed, qs)
    absmax, shp, dt, kw = _raw(qs)
    out = nf4_dequantize(packed, absmax, shp, dt, **kw)
    assert out.shape == shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, expected)
    assert torch.equal(nf4_dequantize_reference(packed, absmax, shp, dt, **kw), expected)
    # not a trivial pass: the values are spread over the 16 levels and the block scales
    assert expected.unique().numel() > 100


def test_odd_element_count():
    # 35 elements: the last byte's low nibble is padding
    packed, qs = _quantized((5, 7), torch.bfloat16, nested=True)
    absmax, shp, dt, kw = _raw(qs)
    expected = formula(packed, qs)
    assert torch.equal(nf4_dequantize(packed, absmax, shp, dt, **kw), expected)
    assert torch.equal(nf4_dequantize_reference(packed, absmax, shp, dt, **kw), expected)


@pytest.mark.parametrize("blocksize", [32, 4096])  # 4096: one block is wider than a program's default tile
def test_other_blocksizes(blocksize):
    packed, qs = _quantized((37, 260), torch.bfloat16, nested=True, blocksize=blocksize)
    absmax, shp, dt, kw = _raw(qs)
    assert torch.equal(nf4_dequantize(packed, absmax, shp, dt, **kw), formula(packed, qs))


def test_absmax_in_torch_variant(monkeypatch):
    monkeypatch.setitem(nf4_mod.TUNING, "absmax", "torch")
    monkeypatch.setitem(nf4_mod.TUNING, "bytes_per_program", 256)  # 8 blocks per program
    packed, qs = _quantized((129, 160), torch.bfloat16, nested=True)
    absmax, shp, dt, kw = _raw(qs)
    assert torch.equal(nf4_dequantize(packed, absmax, shp, dt, **kw), formula(packed, qs))


# bitsandbytes' own dequantization: the formula above is what it computes (on CPU: its scalar path, its AVX-512
# path where that is right, its torch fallback for odd widths (5x7) and blocks of 2048 and more)
BNB_CASES = [((37, 130), 64), ((129, 160), 64), ((5, 7), 64), ((37, 260), 32), ((37, 260), 4096)]


def test_bitsandbytes_dequantize_matches_the_formula():
    problem = dequant_problem()
    if problem is not None:
        pytest.skip(problem)
    for shape, blocksize in BNB_CASES:
        for nested in (False, True):
            for dtype in DTYPES:
                packed, qs = _quantized(shape, dtype, nested, blocksize=blocksize)
                with torch.compiler.set_stance("force_eager"):  # (its torch fallback is compiled: seconds per shape)
                    theirs = bnbf.dequantize_4bit(packed, qs, quant_type="nf4")
                assert torch.equal(theirs, formula(packed, qs)), (shape, blocksize, nested, dtype)


def test_the_bitsandbytes_check_finds_a_wrong_dequantization():
    """foak.patching.bnb_cpu.probe compares with the formula: a bitsandbytes whose CPU kernel put every block's
    scale one block late is found wrong, the formula kernel foak.testing installs is found right."""
    from foak.patching import bnb_cpu
    from foak.testing import _formula_dequantize_4bit

    def one_block_late(A, absmax, blocksize, quant_type, shape, dtype):
        return _formula_dequantize_4bit(A, absmax.roll(1), blocksize, quant_type, shape, dtype)

    for kernel, wrong in ((one_block_late, True), (_formula_dequantize_4bit, False)):
        library = torch.library.Library("bitsandbytes", "IMPL")
        library.impl("dequantize_4bit", kernel, "CPU")
        bnb_cpu.forget()
        try:
            assert (bnb_cpu.probe(3, 96, 64, torch.float32, True) > bnb_cpu.WRONG) == wrong
        finally:
            library._destroy()
            bnb_cpu.forget()


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
    assert torch.equal(nf4_dequantize(packed, absmax, shp, dt, **kw), formula(packed, qs))


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
    assert torch.equal(a, formula(packed, qs))
    full = weight.dequantize(torch.float32)
    assert torch.equal(full, formula(packed, qs, torch.float32))  # the unrounded fp32 products
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


# what foak.patch says about bitsandbytes' CPU dequantization ----------------------------------------------------
def _tiny_qlora():
    """The tiny Llama (rows of 64, down_proj's of 96) with bitsandbytes NF4 bases under PEFT LoRA, on CPU."""
    import peft

    from foak.bench.step import quantize_nf4
    from foak.models.tiny import tiny_model

    model = quantize_nf4(tiny_model("llama", seed=1), "cpu", torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))


def _patch_and_warnings(model, **switches):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = foak.patch(model, **switches)
        assert foak.patch(model, **switches) is report  # patching twice: the same report, said once
    foak.restore(model)
    return report, [str(w.message) for w in caught if "dequantize_4bit" in str(w.message)]


def test_patch_reports_nf4_layers_bitsandbytes_dequantizes_wrong_on_this_cpu(monkeypatch):
    from foak.patching import bnb_cpu
    from foak.testing import _formula_dequantize_4bit

    monkeypatch.setattr(bnb_cpu, "_WARNED", set())
    model = _tiny_qlora()
    # this machine's bitsandbytes: on an AVX-512 CPU, 0.50.2 is wrong for down_proj's rows of 96 (not a multiple
    # of the 64-element blocks), right for the others
    report, warned = _patch_and_warnings(model, fused_lora=True)
    notes = report.result("llama.fused_lora").notes
    assert report.result("llama.fused_lora").modules == 14 and "bases: 14 bitsandbytes NF4 Linear4bit" in notes
    if dequant_problem() is None:
        assert "dequantize_4bit" not in notes and not warned, (notes, warned)
    else:
        assert f"bitsandbytes {bnb_cpu.bnb_version()} CPU dequantize_4bit wrong here for 2/14 NF4 layers " \
               "(in_features 96): foak's fused path unaffected" in notes, notes
        assert len(warned) == 1, warned
        assert "for 2 of the model's 14 NF4 layers (in_features 96; relative error up to 0." in warned[0], warned
        assert "foak's fused QLoRA path (its own NF4 dequantization) is unaffected" in warned[0], warned

    # a bitsandbytes whose CPU kernel gives each block the next block's scale: wrong for every layer
    def one_block_late(A, absmax, blocksize, quant_type, shape, dtype):
        return _formula_dequantize_4bit(A, absmax.roll(-1), blocksize, quant_type, shape, dtype)

    library = torch.library.Library("bitsandbytes", "IMPL")
    library.impl("dequantize_4bit", one_block_late, "CPU")
    bnb_cpu.forget()
    try:
        report, warned = _patch_and_warnings(model, fused_lora=True)
        assert "wrong here for 14/14 NF4 layers (in_features 64, 96)" in report.result("llama.fused_lora").notes
        assert report.result("llama.fused_lora").notes.count("wrong here") == 1
        assert len(warned) == 1 and "for 14 of the model's 14 NF4 layers" in warned[0], warned
        # without fused_lora every 4-bit layer runs bitsandbytes' forward: a row of its own (warned once only)
        report, warned = _patch_and_warnings(model, fast_rms_layernorm=True)
        row = report.result("llama.bitsandbytes_cpu")
        assert row.modules == 0 and "wrong here for 14/14 NF4 layers" in row.notes and not warned
    finally:
        library._destroy()
        bnb_cpu.forget()


def test_a_weight_bitsandbytes_repacked_for_its_cpu_inference_kernel_is_left_to_peft():
    # (bitsandbytes does it on AVX512-BF16 CPUs at a Linear4bit's first eval-mode call without grad: another
    # nibble layout and bf16 scales, which foak's NF4 dequantization must not read as NF4)
    model = _tiny_qlora()
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    q_proj.base_layer.weight.quant_state.packing_format_for_cpu = True
    report = foak.patch(model, fused_lora=True)
    foak.restore(model)
    notes = report.result("llama.fused_lora").notes
    assert "bases: 13 bitsandbytes NF4 Linear4bit" in notes, notes
    assert "left to PEFT: 1 Linear4bit (weight repacked by bitsandbytes for its CPU inference kernel " \
           "(packing_format_for_cpu))" in notes, notes
