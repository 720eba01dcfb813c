import pytest
import torch
from conftest import assert_case

from foak.ops.rms_norm import rms_norm, rms_norm_reference
from foak.testing import relative_error, rms_norm_case

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(37, 129), (3, 5, 257), (2, 3, 7, 1000), (5, 20000)]  # the last takes the chunked (>16384) path


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", ["llama", "gemma"])
def test_matches_reference(shape, mode, dtype):
    errors = assert_case(rms_norm_case(shape, mode=mode), dtype)
    assert set(errors) == {"out0", "grad_x", "grad_weight"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_largest_supported_hidden_size(dtype):
    assert_case(rms_norm_case((2, 65536)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 129), (2, 9, 65), (3, 17000)])
@pytest.mark.parametrize("mode", ["llama", "gemma"])
def test_residual_matches_reference(shape, mode, dtype):
    errors = assert_case(rms_norm_case(shape, mode=mode, residual=True), dtype)
    assert set(errors) == {"out0", "out1", "grad_x", "grad_weight", "grad_residual"}


def test_residual_sum_is_rounded_like_hf():
    x = torch.randn(11, 33, dtype=torch.bfloat16)
    r = torch.randn(11, 33, dtype=torch.bfloat16)
    w = torch.randn(33, dtype=torch.bfloat16)
    y, total = rms_norm(x, w, residual=r)
    assert torch.equal(total, x + r)  # bf16 add, exactly as the HF decoder layer does
    y_ref = rms_norm_reference(x + r, w)
    assert relative_error(y, y_ref) < 4e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 129), (5, 20000)])  # one-block and chunked paths
def test_olmo_mode_matches_reference(shape, dtype):
    errors = assert_case(rms_norm_case(shape, mode="olmo"), dtype)
    assert set(errors) == {"out0", "grad_x", "grad_weight"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_olmo_mode_residual_matches_reference(dtype):
    assert_case(rms_norm_case((2, 9, 65), mode="olmo", residual=True), dtype)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(21, 77), (3, 17000)])
def test_olmo_mode_rounds_once_like_olmo2_rms_norm(shape, w_dtype):
    # Olmo2RMSNorm: (weight * normalised_fp32).to(input_dtype): one rounding of the fp32 product, output in
    # the input dtype whatever the weight's dtype; "llama" rounds the normalised input before the product
    x = torch.randn(shape).to(torch.bfloat16)
    w = (torch.rand(shape[-1]) * 2 + 0.1).to(w_dtype)
    xf = x.float()
    hf = (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))).to(torch.bfloat16)
    y = rms_norm(x, w, eps=1e-6, mode="olmo")
    assert torch.equal(rms_norm_reference(x, w, 1e-6, "olmo"), hf)
    assert y.dtype == torch.bfloat16
    assert (y.float() - hf.float()).abs().max() <= hf.float().abs().max() * 2**-8  # within one bf16 ulp
    assert (y == hf).float().mean() > 0.99  # bit-equal but for rsqrt's last bit on a few ties
    llama = rms_norm(x, w, eps=1e-6, mode="llama").to(torch.bfloat16)
    assert (llama != hf).float().mean() > 0.1  # the two modes round differently: the test can tell them apart


def test_gemma_offset_is_one_plus_weight():
    x = torch.randn(9, 47)
    w = torch.zeros(47)  # gemma with w = 0 is a plain normalisation
    y = rms_norm(x, w, eps=0.0, mode="gemma")
    expected = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    assert relative_error(y, expected) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 129), (3, 17000)])  # one block per row; the chunked path
@pytest.mark.parametrize("residual", [False, True])
def test_gemma4_matches_reference(shape, residual, dtype):
    errors = assert_case(rms_norm_case(shape, mode="olmo", residual=residual), dtype)
    assert {"out0", "grad_x", "grad_weight"} <= set(errors)


def test_gemma4_multiplies_in_fp32_like_hf():
    """Gemma 4's norm: (x * rsqrt(mean(x^2) + eps) * w) in fp32, one rounding to bf16 at the end; with a ones
    weight, its norms without a scale (with_scale=False) exactly."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 65, generator=g).to(torch.bfloat16)
    w = (torch.randn(65, generator=g) * 0.5 + 1).to(torch.bfloat16)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    y = rms_norm(x, w, eps=1e-6, mode="olmo")
    assert y.dtype == torch.bfloat16
    assert (y.float() - (h * w.float()).to(torch.bfloat16).float()).abs().max() <= 2 ** -7 * h.abs().max()
    assert relative_error(y, (h * w.float()).to(torch.bfloat16)) < 1e-3
    unit = rms_norm(x, torch.ones(65, dtype=torch.bfloat16), eps=1e-6, mode="olmo")
    assert torch.equal(unit, rms_norm(x, torch.zeros(65, dtype=torch.bfloat16), eps=1e-6, mode="gemma"))
    assert relative_error(unit, h.to(torch.bfloat16)) < 1e-3


def test_eps_is_used():
    x = torch.full((3, 16), 1e-3) * torch.randn(3, 16).sign()
    w = torch.ones(16)
    y_small, y_big = rms_norm(x, w, eps=1e-12), rms_norm(x, w, eps=1.0)
    assert relative_error(y_small, rms_norm_reference(x, w, 1e-12)) < 1e-6
    assert relative_error(y_big, rms_norm_reference(x, w, 1.0)) < 1e-6
    assert y_big.abs().max() < 0.01 < y_small.abs().min()


def test_llama_mode_promotes_to_fp32_weight():
    x = torch.randn(13, 65, dtype=torch.bfloat16)
    w = torch.randn(65, dtype=torch.float32)
    y = rms_norm(x, w)
    ref = rms_norm_reference(x, w)
    assert y.dtype == ref.dtype == torch.float32
    assert relative_error(y, ref) < 1e-6


@pytest.mark.parametrize("layout", ["sliced", "transposed"])
def test_non_contiguous_input(layout):
    base = torch.randn(21, 300) if layout == "sliced" else torch.randn(129, 21)
    x = (base[:, :129] if layout == "sliced" else base.t()).requires_grad_()
    assert not x.is_contiguous()
    w = torch.randn(129, requires_grad=True)
    dy = torch.randn(21, 129)
    y = rms_norm(x, w)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = rms_norm_reference(xr, wr)
    gxr, gwr = torch.autograd.grad(yr, (xr, wr), dy)
    assert relative_error(y, yr) < 1e-6
    assert relative_error(gx, gxr) < 1e-5
    assert relative_error(gw, gwr) < 1e-5


def test_weight_grad_accumulates_over_all_rows():
    # more rows than the backward has programs: each program's partial row must be summed
    x = torch.randn(4, 50, 33, requires_grad=True)
    w = torch.randn(33, requires_grad=True)
    rms_norm(x, w).sum().backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rms_norm_reference(xr, wr).sum().backward()
    assert relative_error(w.grad, wr.grad) < 1e-5


def test_inplace_backward_reuses_intermediate_input_memory():
    x0 = torch.randn(23, 129, requires_grad=True)
    w = torch.randn(129, requires_grad=True)
    x = x0 * 1.0  # an intermediate, like the residual stream entering a norm
    x_ptr, x_vals = x.data_ptr(), x.detach().clone()
    dy = torch.randn(23, 129)
    dx, dw = torch.autograd.grad(rms_norm(x, w), (x, w), dy)
    assert dx.data_ptr() == x_ptr  # no new allocation for dx
    xr, wr = x_vals.requires_grad_(), w.detach().clone().requires_grad_()
    dxr, dwr = torch.autograd.grad(rms_norm_reference(xr, wr), (xr, wr), dy)
    assert relative_error(dx, dxr) < 1e-5 and relative_error(dw, dwr) < 1e-5


def test_inplace_backward_is_loud_when_another_op_saved_the_input():
    x0, w = torch.randn(5, 33, requires_grad=True), torch.randn(33)
    x = x0 * 1.0
    other = x * x0  # saves x before the norm, whose backward (which runs first) would overwrite it
    y = rms_norm(x, w)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (y.sum() + other.sum()).backward()
    x = x0 * 1.0
    other = x * x0
    (rms_norm(x, w, inplace_backward=False).sum() + other.sum()).backward()  # opting out works


def test_leaf_and_view_inputs_are_never_overwritten():
    base = torch.randn(6, 40, requires_grad=True)
    for x in (base, base[:, :33], (base * 1.0)[:, 3:36]):
        before = x.detach().clone()
        rms_norm(x, torch.randn(x.shape[-1])).sum().backward()
        assert torch.equal(x.detach(), before)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weight": torch.randn(10)}, "weight must be 1-D with the hidden size"),
        ({"weight": torch.randn(2, 16)}, "weight must be 1-D"),
        ({"x": torch.randint(0, 5, (4, 16))}, "x has dtype torch.int64"),
        ({"weight": torch.randn(16, dtype=torch.float64)}, "weight has dtype torch.float64"),
        ({"residual": torch.randn(4, 15)}, "residual has shape"),
        ({"residual": torch.randn(4, 16, dtype=torch.bfloat16)}, "tensors must share one dtype"),
        ({"mode": "gema"}, "mode must be one of"),
        ({"eps": -1.0}, "eps must be a non-negative"),
        ({"weight": torch.randn(16, device="meta")}, "all tensors must be on one device"),
        ({"x": torch.tensor(1.0)}, "non-empty last dimension"),
        ({"x": torch.randn(1, 65537), "weight": torch.randn(65537)}, "exceeds the supported maximum 65536"),
    ],
)
def test_bad_input(kwargs, message):
    args = {"x": torch.randn(4, 16), "weight": torch.randn(16), "eps": 1e-6, "mode": "llama", "residual": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        rms_norm(**args)


def test_interpreter_compat_rounds_bf16_to_nearest_even():
    # guards the test-only interpreter fix: kernels' bf16 stores must round like the GPU and torch
    x = torch.randn(64, 129)
    w = torch.ones(129)
    y = rms_norm(x.to(torch.bfloat16), w.to(torch.bfloat16), eps=0.0, mode="gemma")  # no double rounding
    exact = (x.to(torch.bfloat16).float() * torch.rsqrt(x.to(torch.bfloat16).float().pow(2).mean(-1, keepdim=True)) * 2)
    assert torch.equal(y, exact.to(torch.bfloat16))
