import pytest
import torch
from conftest import assert_case

from foak.ops.activations import geglu, glu, glu_reference, swiglu
from foak.testing import glu_case, relative_error

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(37, 129), (2, 3, 257), (1, 5000), (3, 5, 7)]
ACTIVATIONS = ["silu", "gelu", "gelu_tanh"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_reference(shape, activation, dtype):
    errors = assert_case(glu_case(shape, activation), dtype)
    assert set(errors) == {"out0", "grad_g", "grad_u"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_chunked_halves_of_one_tensor(activation, dtype):
    # strided, non-contiguous views into one intermediate (a fused gate_up output): out-of-place backward
    assert_case(glu_case((13, 77), activation, chunked=True), dtype)


def test_public_names_pick_the_activation():
    g, u = torch.randn(9, 31), torch.randn(9, 31)
    assert torch.equal(swiglu(g, u), glu(g, u, "silu"))
    assert torch.equal(geglu(g, u), glu(g, u, "gelu"))
    assert torch.equal(geglu(g, u, approximate="tanh"), glu(g, u, "gelu_tanh"))
    assert relative_error(geglu(g, u), torch.nn.functional.gelu(g) * u) < 1e-6
    assert relative_error(geglu(g, u, "tanh"), torch.nn.functional.gelu(g, approximate="tanh") * u) < 1e-6
    assert relative_error(swiglu(g, u), torch.nn.functional.silu(g) * u) < 1e-6


def _intermediates(shape=(11, 45)):
    g0, u0 = torch.randn(shape, requires_grad=True), torch.randn(shape, requires_grad=True)
    return g0, u0, g0 * 1.0, u0 * 1.0


def test_inplace_backward_reuses_intermediate_storage():
    _g0, _u0, g, u = _intermediates()
    g_ptr, g_vals, u_vals = g.data_ptr(), g.detach().clone(), u.detach().clone()
    h = swiglu(g, u)
    dh = torch.randn_like(h)
    dg, du = torch.autograd.grad(h, (g, u), dh)
    assert dg.data_ptr() == g_ptr  # no new allocation for dg
    gr, ur = g_vals.clone().requires_grad_(), u_vals.clone().requires_grad_()
    dgr, dur = torch.autograd.grad(glu_reference(gr, ur), (gr, ur), dh)
    assert relative_error(dg, dgr) < 1e-5 and relative_error(du, dur) < 1e-5


def test_inplace_backward_is_loud_when_another_op_saved_the_input():
    _g0, u0, g, u = _intermediates()
    other = g * u0  # saves g before swiglu: swiglu's backward (which runs first) would overwrite it
    h = swiglu(g, u)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (h.sum() + other.sum()).backward()


def test_inplace_backward_can_be_disabled():
    g0, u0, g, u = _intermediates()
    other = g * u0
    h = swiglu(g, u, inplace_backward=False)
    (h.sum() + other.sum()).backward()
    gr, ur = g0.detach().clone().requires_grad_(), u0.detach().clone().requires_grad_()
    (glu_reference(gr, ur).sum() + (gr * ur).sum()).backward()
    assert relative_error(g0.grad, gr.grad) < 1e-5 and relative_error(u0.grad, ur.grad) < 1e-5


@pytest.mark.parametrize("split", ["slices_of_leaves", "chunk_dim0_of_intermediate", "same_tensor"])
def test_views_and_aliases_take_the_out_of_place_backward(split):
    base = torch.randn(10, 33, requires_grad=True)
    other = torch.randn(10, 33, requires_grad=True)
    if split == "slices_of_leaves":
        g, u = base[:5], other[:5]  # views of leaves have a grad_fn but must not be overwritten
    elif split == "chunk_dim0_of_intermediate":
        g, u = (base * 1.0).chunk(2, 0)  # multi-output views: autograd forbids in-place writes
    else:
        g = u = base * 1.0
    before = (base.detach().clone(), other.detach().clone())
    h = swiglu(g, u)
    dh = torch.randn_like(h)
    dg, du = torch.autograd.grad(h, (g, u), dh)
    assert torch.equal(base.detach(), before[0]) and torch.equal(other.detach(), before[1])
    gr = g.detach().clone().requires_grad_()
    ur = gr if g is u else u.detach().clone().requires_grad_()  # same tensor: grads w.r.t. it add up
    dgr, dur = torch.autograd.grad(glu_reference(gr, ur), (gr, ur), dh)
    assert relative_error(dg, dgr) < 1e-5 and relative_error(du, dur) < 1e-5


def test_leaf_inputs_are_never_overwritten():
    g, u = torch.randn(7, 33, requires_grad=True), torch.randn(7, 33, requires_grad=True)
    g_before, u_before = g.detach().clone(), u.detach().clone()
    swiglu(g, u).sum().backward()
    assert torch.equal(g.detach(), g_before) and torch.equal(u.detach(), u_before)
    assert g.grad is not None and g.grad.data_ptr() != g.data_ptr()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: swiglu(torch.randn(4, 8), torch.randn(4, 9)), "g and u must have the same shape"),
        (lambda: swiglu(torch.randn(4, 8), torch.randn(4, 8, dtype=torch.bfloat16)), "tensors must share one dtype"),
        (lambda: swiglu(torch.randint(0, 3, (4, 8)), torch.randint(0, 3, (4, 8))), "g has dtype torch.int64"),
        (lambda: swiglu(torch.randn(4, 8), torch.randn(4, 8, device="meta")), "all tensors must be on one device"),
        (lambda: swiglu(torch.tensor(1.0), torch.tensor(2.0)), "at least one dimension"),
        (lambda: glu(torch.randn(4, 8), torch.randn(4, 8), "relu"), "activation must be one of"),
        (lambda: geglu(torch.randn(4, 8), torch.randn(4, 8), approximate="fast"), "approximate must be 'none' or 'tanh'"),
        (lambda: swiglu(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)), "float64"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
