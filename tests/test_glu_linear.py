import pytest
import torch
from conftest import assert_case

from foak.ops.glu_linear import glu_linear, glu_linear_reference
from foak.testing import glu_linear_case, relative_error

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "out_features", "activation", "bias", "chunked"),
    [((37, 129), 33, "silu", False, False), ((2, 3, 257), 19, "gelu", True, False),
     ((5, 67), 21, "gelu_tanh", False, True), ((1, 1000), 7, "silu", True, True)],
)
def test_matches_reference(shape, out_features, activation, bias, chunked, dtype):
    errors = assert_case(glu_linear_case(shape, out_features, activation, bias, chunked), dtype)
    assert set(errors) == {"out0", "grad_g", "grad_u", "grad_weight"} | ({"grad_bias"} if bias else set())


def _mlp_inputs(dtype=torch.float32, tokens=(3, 11), inner=45, outer=17):
    """g and u as the outputs of two projections (autograd intermediates), as in a gated MLP."""
    x = torch.randn(*tokens, outer, dtype=dtype, requires_grad=True)
    wg, wu = (torch.randn(inner, outer, dtype=dtype, requires_grad=True) for _ in range(2))
    wd = (torch.randn(outer, inner) * inner**-0.5).to(dtype).requires_grad_()
    return x, wg, wu, wd


@pytest.mark.parametrize("dtype", DTYPES)
def test_inside_an_mlp_with_inplace_backward(dtype):
    x, wg, wu, wd = _mlp_inputs(dtype)
    leaves = (x, wg, wu, wd)
    dout = torch.randn(3, 11, 17, dtype=dtype)
    g, u = x @ wg.t(), x @ wu.t()
    g_ptr = g.data_ptr()
    out = glu_linear(g, u, wd)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    rx, rwg, rwu, rwd = ref_leaves
    ref_out = glu_linear_reference(rx @ rwg.t(), rx @ rwu.t(), rwd)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.float())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert relative_error(out, ref_out) < tol
    for got, ref in zip(grads, ref_grads):
        assert relative_error(got, ref) < tol
    assert g.data_ptr() == g_ptr and not torch.equal(g, x @ wg.t())  # dg was written into g's memory


def test_frozen_weight_gets_no_gradient_and_costs_no_gemm():
    x, wg, wu, wd = _mlp_inputs()
    wd.requires_grad_(False)
    out = glu_linear(x @ wg.t(), x @ wu.t(), wd)
    out.sum().backward()
    assert wd.grad is None and wg.grad is not None and x.grad is not None


def test_product_is_not_kept_for_the_backward():
    # a plain linear(glu(g, u)) saves the [tokens, intermediate] product; glu_linear saves g, u, weight only
    x, wg, wu, wd = _mlp_inputs(tokens=(2, 7), inner=96)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    g, u = x @ wg.t(), x @ wu.t()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        glu_linear(g, u, wd)
    activations = [t for t in saved if t.numel() == 2 * 7 * 96]  # [tokens, intermediate] tensors
    ptrs = {t.untyped_storage().data_ptr() for t in activations}
    assert ptrs == {g.untyped_storage().data_ptr(), u.untyped_storage().data_ptr()}


def test_autocast_casts_the_weight_like_linear():
    x, wg, wu, wd = _mlp_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g, u = x @ wg.t(), x @ wu.t()
        out = glu_linear(g, u, wd)
        ref = torch.nn.functional.linear(torch.nn.functional.silu(g) * u, wd)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, ref) < 1e-2
    out.float().sum().backward()
    assert wd.grad.dtype == torch.float32 and torch.isfinite(wd.grad).all()


def test_bad_input_is_a_clear_error():
    g, u = torch.randn(4, 9), torch.randn(4, 9)
    with pytest.raises(ValueError, match=r"weight must be \[out_features, 9\]"):
        glu_linear(g, u, torch.randn(5, 8))
    with pytest.raises(ValueError, match="one shape"):
        glu_linear(g, torch.randn(4, 8), torch.randn(5, 9))
    with pytest.raises(ValueError, match=r"bias must be \[5\]"):
        glu_linear(g, u, torch.randn(5, 9), torch.randn(4))
    with pytest.raises(ValueError, match="activation must be one of"):
        glu_linear(g, u, torch.randn(5, 9), activation="relu")
    with pytest.raises(ValueError, match="share one dtype"):
        glu_linear(g, u, torch.randn(5, 9, dtype=torch.float64).bfloat16())


def test_compiles_fullgraph():
    x, wg, wu, wd = _mlp_inputs()
    fn = torch.compile(lambda x: glu_linear(x @ wg.t(), x @ wu.t(), wd), backend="aot_eager", fullgraph=True)
    out = fn(x)
    out.sum().backward()
    grads = (x.grad.clone(), wd.grad.clone())
    x.grad = wd.grad = None
    glu_linear(x @ wg.t(), x @ wu.t(), wd).sum().backward()
    assert torch.allclose(out, glu_linear(x @ wg.t(), x @ wu.t(), wd), atol=1e-6)
    assert torch.allclose(grads[0], x.grad, atol=1e-5) and torch.allclose(grads[1], wd.grad, atol=1e-5)


def test_custom_op_passes_opcheck():
    dh, g, u = torch.randn(5, 33), torch.randn(5, 33), torch.randn(5, 33)
    from foak.ops.glu_linear import _backward_op

    torch.library.opcheck(_backward_op.custom_op, (dh, g, u, "silu"))


def _counting_linear(monkeypatch):
    """F.linear calls that completed, by weight shape (a checkpoint's early stop raises before an op runs)."""
    import collections

    done = collections.Counter()
    original = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        out = original(x, weight, bias)
        done[tuple(weight.shape)] += 1
        return out

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    return done


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recompute_stops_before_the_down_projection(monkeypatch, reentrant):
    # a gated MLP under activation checkpointing: non-reentrant checkpointing recomputes the forward only until the
    # MLP's saved tensors are back, so the down projection's GEMM is not run again (as for an nn.Linear); reentrant
    # checkpointing recomputes everything. Loss and every gradient equal the un-checkpointed MLP's.
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    x, wg, wu, wd = _mlp_inputs(tokens=(2, 13), inner=67, outer=19)
    dout = torch.randn(2, 13, 19)

    def mlp(x):
        return glu_linear(torch.nn.functional.linear(x, wg), torch.nn.functional.linear(x, wu), wd) * 1.0

    leaves = (x, wg, wu, wd)
    want = torch.autograd.grad(mlp(x), leaves, dout)
    done = _counting_linear(monkeypatch)
    checkpoint(mlp, x, use_reentrant=reentrant).backward(dout)  # (reentrant checkpointing refuses autograd.grad)
    for a, b in zip((t.grad for t in leaves), want):
        assert relative_error(a, b) < 1e-6
    assert done[(67, 19)] == 4  # gate and up: forward and recompute
    assert done[(19, 67)] == (2 if reentrant else 1)  # the down projection: once more only when reentrant


def test_saved_tensors_are_released_after_the_backward():
    # the node that saves g, u and the weight ahead of the GEMM runs right after it in the backward and frees them
    import gc
    import weakref

    x, wg, wu, wd = _mlp_inputs()
    g, u = x @ wg.t(), x @ wu.t()
    out = glu_linear(g, u, wd)
    g_ref = weakref.ref(g)
    del g, u
    out.sum().backward(retain_graph=False)
    gc.collect()
    assert g_ref() is None and out.grad_fn is not None
    assert wd.grad is not None and x.grad is not None


def test_second_backward_with_retain_graph():
    # the saving node keeps its tensors under retain_graph (inplace_backward=False: the inputs stay intact)
    x, wg, wu, wd = _mlp_inputs()
    out = glu_linear(x @ wg.t(), x @ wu.t(), wd, inplace_backward=False)
    first = torch.autograd.grad(out.sum(), (x, wd), retain_graph=True)
    second = torch.autograd.grad(out.sum(), (x, wd))
    assert all(relative_error(a, b) == 0 for a, b in zip(first, second))


def test_second_backward_after_an_inplace_backward_is_an_error():
    # the in-place backward writes dg, du over g, u: a second backward through the retained graph would read
    # gradients as activations; autograd's version check refuses it (glu_linear, glu, rms_norm alike)
    from foak.ops.activations import glu
    from foak.ops.rms_norm import rms_norm

    x, wg, wu, wd = _mlp_inputs()
    norm_weight = torch.ones(17, requires_grad=True)
    for name, fn in (("glu_linear", lambda h: glu_linear(h @ wg.t(), h @ wu.t(), wd)),
                     ("glu", lambda h: glu(h @ wg.t(), h @ wu.t())),
                     ("rms_norm", lambda h: rms_norm(h * 2, norm_weight))):
        out = fn(x)
        torch.autograd.grad(out.sum(), x, retain_graph=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(out.sum(), x)
