"""foak.ops.gptq_matmul in the Triton interpreter: the GEMM with the GPTQ dequantization in its inner loop
against an fp64 computation on the format's weight and against torch's F.linear at the same dtype, forward
and backward; plain groups, act-order, one group, groups smaller than the K tile; tails in M, N and K;
split-K; non-contiguous inputs; which path gptq_linear takes (kernel launches counted); the errors."""

import pytest
import torch
import torch.nn.functional as F

from foak.ops import gptq_matmul as mm_mod
from foak.ops.gptq import GPTQWeight, gptq_dequantize_reference, gptq_quantize_rtn
from foak.ops.gptq_matmul import gptq_linear, gptq_matmul

# small tiles so the test shapes cross block boundaries in every dimension
SMALL = {"block_m": 16, "block_n": 16, "block_k": 32, "split_k": 2, "warps": 1, "stages": 1, "by_nibble": False,
         "max_rows": 20, "act_order_max_rows": 20, "wide_from_rows": 10**9, "wide": {}}


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    for key, value in SMALL.items():
        monkeypatch.setitem(mm_mod.TUNING, key, value)


@pytest.fixture
def launches(monkeypatch):
    count = {"n": 0}
    launch = mm_mod._launch

    def counted(*args):
        count["n"] += 1
        return launch(*args)

    monkeypatch.setattr(mm_mod, "_launch", counted)
    return count


def packed_weight(out_f, in_f, group_size, act_order=False, sym=True, zero_offset=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    return gptq_quantize_rtn(w, group_size, sym=sym, act_order=act_order, zero_offset=zero_offset)


def exact(x, packed, bias, zero_offset=1):
    """fp64 x W^T + b with W the format's exact values."""
    w = gptq_dequantize_reference(**packed, dtype=torch.float64, zero_offset=zero_offset)
    y = x.double() @ w.t()
    return y if bias is None else y + bias.double()


# (out, in, group_size, act_order, sym, zero_offset): 136 = 4 K tiles + 8, 40 = 2 N tiles + 8
CASES = [
    (40, 136, 32, False, True, 1),    # plain groups, group == K tile
    (40, 136, 64, False, False, 0),   # plain groups, asymmetric, gptq_v2 zeros, group = 2 K tiles
    (40, 136, 16, False, True, 1),    # groups smaller than the K tile: per-channel gather
    (40, 136, 32, True, False, 1),    # act-order
    (24, 72, -1, False, True, 1),     # one group
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}g{c[2]}{'ao' if c[3] else ''}")
def test_fp32_matches_fp64_forward_and_backward(case, launches):
    out_f, in_f, group, act_order, sym, zero_offset = case
    packed = packed_weight(out_f, in_f, group, act_order, sym, zero_offset)
    weight = GPTQWeight(**packed, dtype=torch.float32, zero_offset=zero_offset)
    x = torch.randn(37, in_f, requires_grad=True)  # 37 rows: 3 M tiles
    bias = torch.randn(out_f, requires_grad=True)
    y = gptq_matmul(x, weight, bias)
    assert launches["n"] == 1
    ref = exact(x.detach(), packed, bias.detach(), zero_offset)
    assert y.dtype == torch.float32 and y.shape == (37, out_f)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    w = gptq_dequantize_reference(**packed, dtype=torch.float64, zero_offset=zero_offset)
    torch.testing.assert_close(x.grad.double(), dy.double() @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias.grad.double(), dy.double().sum(0), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_within_torch_error(dtype):
    """bf16/fp16: no further from fp64 than torch's own F.linear on the dequantized weight (2x margin)."""
    packed = packed_weight(40, 136, 32, act_order=True)
    weight = GPTQWeight(**packed, dtype=dtype)
    x = torch.randn(3, 7, 136).to(dtype)  # 3-D input
    y = gptq_matmul(x, weight)
    ref = exact(x.reshape(-1, 136), packed, None).reshape(3, 7, 40)
    torch_y = F.linear(x.float(), weight.dequantize(torch.float32)).to(dtype)
    ours, theirs = (y.double() - ref).abs().max().item(), (torch_y.double() - ref).abs().max().item()
    assert y.dtype == dtype and y.shape == (3, 7, 40)
    assert ours <= 2 * theirs + 1e-3, (ours, theirs)


def test_non_contiguous_input_and_split_k(monkeypatch):
    packed = packed_weight(40, 136, 32)
    weight = GPTQWeight(**packed, dtype=torch.float32)
    base = torch.randn(136, 50)
    x = base.t()[5:42]  # [37, 136], stride (1, 50)
    assert not x.is_contiguous()
    ref = exact(x, packed, None)
    for split in (1, 3, 8):  # 8 > number of K tiles (5): clamped
        monkeypatch.setitem(mm_mod.TUNING, "split_k", split)
        torch.testing.assert_close(gptq_matmul(x, weight).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "act"])
def test_by_nibble_and_wide_tiles(monkeypatch, act_order):
    # eight dots per K tile (block_k 128: 16 words), and the "wide" overrides from 17 rows on
    monkeypatch.setitem(mm_mod.TUNING, "by_nibble", True)
    monkeypatch.setitem(mm_mod.TUNING, "block_k", 128)
    monkeypatch.setitem(mm_mod.TUNING, "wide_from_rows", 17)
    monkeypatch.setitem(mm_mod.TUNING, "wide", {"block_m": 32, "split_k": 1})
    packed = packed_weight(40, 264, 128 if not act_order else 32, act_order=act_order)  # 264 = 2 K tiles + 8
    weight = GPTQWeight(**packed, dtype=torch.float32)
    for rows in (5, 37):
        x = torch.randn(rows, 264)
        torch.testing.assert_close(gptq_matmul(x, weight).double(), exact(x, packed, None), rtol=1e-5, atol=1e-5)


def test_gptq_linear_picks_kernel_by_rows(launches):
    packed = packed_weight(40, 136, 32)
    weight = GPTQWeight(**packed, dtype=torch.float32)
    few, many = torch.randn(20, 136), torch.randn(21, 136)  # max_rows = 20
    y_few, y_many = gptq_linear(few, weight), gptq_linear(many, weight)
    assert launches["n"] == 1  # only the 20-row call ran the fused kernel
    torch.testing.assert_close(y_few.double(), exact(few, packed, None), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_many.double(), exact(many, packed, None), rtol=1e-5, atol=1e-5)
    mm_mod.TUNING["act_order_max_rows"] = 0
    act = GPTQWeight(**packed_weight(40, 136, 32, act_order=True), dtype=torch.float32)
    gptq_linear(few, act)
    assert launches["n"] == 1  # act-order: dequantize + cuBLAS


def test_errors():
    weight = GPTQWeight(**packed_weight(40, 136, 32), dtype=torch.float32)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        gptq_matmul(torch.randn(3, 136, dtype=torch.float64), weight)
    with pytest.raises(ValueError, match="in_features=136"):
        gptq_matmul(torch.randn(3, 128), weight)
    with pytest.raises(ValueError, match="GPTQWeight"):
        gptq_matmul(torch.randn(3, 136), torch.randn(40, 136))
    with pytest.raises(ValueError, match=r"bias must be a \[40\]"):
        gptq_matmul(torch.randn(3, 136), weight, torch.randn(41))
