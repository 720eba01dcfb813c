"""foak.ops.lowrank (fp32 rank-sized products over 16-bit operands) against fp64 math, in the Triton interpreter."""

import copy

import pytest
import torch
from test_lora_op import _args, _peft_layer, _peft_layers, _use_mask
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from foak.ops import lowrank as lowrank_mod
from foak.ops.lora import lora_dropout_mask, lora_linear, lora_linears
from foak.ops.lora_glu_linear import lora_glu_linear
from foak.ops.lowrank import lowrank_add_, lowrank_down, lowrank_tokens
from foak.testing import relative_error


@pytest.fixture(params=[True, False], ids=["split", "fma"])
def split(request, monkeypatch):
    """Both ways of forming the products: bf16 parts on the tensor cores, and fp32 FMA dots."""
    monkeypatch.setitem(lowrank_mod.TUNING, "split", request.param)
    return request.param


def _exact(*ts):
    return [t.double() for t in ts]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("m", "k", "r"), [(5, 7, 3), (70, 130, 16), (65, 64, 33)])
def test_down_equals_fp64_math(dtype, m, k, r, split):
    x = torch.randn(m, k).to(dtype)
    a = torch.randn(r, k)
    got = lowrank_down(x, a, 0.5)
    xd, ad = _exact(x, a)
    ref = 0.5 * xd @ ad.t()
    assert got.dtype == torch.float32 and got.shape == (m, r)
    # an fp32 sum of k exact products: within k fp32 roundings of the fp64 value
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=k * 2e-7 * (xd.abs() @ ad.abs().t()).max().item())
    # fp32 accuracy overall (a product that kept only 16 of a's 24 bits would be ~1e-5 off)
    assert relative_error(got, ref) <= 1e-6


def test_down_strided_operands():
    # a = B^T (a transposed view) and a non-contiguous x: the strides are honoured without copies
    x = torch.randn(9, 2 * 40).to(torch.bfloat16)[:, ::2]
    b = torch.randn(40, 6)
    got = lowrank_down(x, b.t())
    torch.testing.assert_close(got, x.float() @ b, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("m", "n", "r"), [(5, 7, 3), (70, 130, 16), (66, 65, 20)])
def test_add_rounds_the_fp32_sum_once(dtype, m, n, r, split):
    out = torch.randn(m, n).to(dtype)
    h, b = torch.randn(m, r), torch.randn(n, r)
    ref = (out.double() + 0.25 * (h.double() @ b.double().t()))
    before = out.clone()
    got = lowrank_add_(out, h, b, 0.25)
    assert got is out
    # the exact sum within the fp32 error of an r-term dot, rounded once to dtype
    bound = (ref.abs() * torch.finfo(dtype).eps + (r + 2) * 2**-24 * 0.25 * (h.double().abs() @ b.double().abs().t())
             + before.double().abs() * 2**-24)
    assert ((got.double() - ref).abs() <= bound).all()
    if dtype != torch.float32:
        # PEFT's own sum (fp32 add, then the cast to 16 bits) agrees but where the fp32 values straddle a rounding
        peft = (before.float() + (h @ b.t()) * 0.25).to(dtype)
        assert (got != peft).float().mean() < 0.01


def test_add_without_accumulate_and_strided_out():
    big = torch.zeros(10, 2 * 17, dtype=torch.bfloat16)
    out = big[:, 1::2]  # column stride 2
    h, a = torch.randn(10, 4), torch.randn(4, 17)
    lowrank_add_(out, h, a.t(), 2.0, accumulate=False)  # b = A^T: (g A) as for an input gradient
    torch.testing.assert_close(out.float(), (2.0 * h @ a).to(torch.bfloat16).float(), rtol=0, atol=0)
    assert (big[:, ::2] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "n", "r"), [(5, 7, 3), (200, 70, 16), (131, 65, 9)])
def test_tokens_equals_fp64_math(dtype, m, n, r, monkeypatch, split):
    # few programs: several row splits per column block (their partial sums added after)
    monkeypatch.setitem(lowrank_mod.TUNING, "programs", 4)
    x, g = torch.randn(m, n).to(dtype), torch.randn(m, r)
    got = lowrank_tokens(x, g, 3.0)
    xd, gd = _exact(x, g)
    ref = 3.0 * xd.t() @ gd
    assert got.dtype == torch.float32 and got.shape == (n, r)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=m * 2e-7 * 3 * (xd.abs().t() @ gd.abs()).max().item())
    assert relative_error(got, ref) <= 1e-6


def test_ranks_past_one_rank_block(monkeypatch, split):
    # ranks in several blocks (stacked q, k, v adapters of a large rank): blocks of 16 here, 64 on the GPU
    monkeypatch.setitem(lowrank_mod.TUNING, "ranks", 16)
    x, a, b = torch.randn(67, 40).to(torch.bfloat16), torch.randn(37, 40), torch.randn(30, 37)
    h = lowrank_down(x, a)
    torch.testing.assert_close(h, x.float() @ a.t(), rtol=1e-6, atol=1e-5)
    out = torch.randn(67, 30).to(torch.bfloat16)
    exact = out.double() + h.double() @ b.double().t()
    assert ((lowrank_add_(out.clone(), h, b).double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()
    torch.testing.assert_close(lowrank_tokens(x, h), x.float().t() @ h, rtol=1e-5, atol=1e-4)


def test_tokens_empty_rows_give_zeros():
    got = lowrank_tokens(torch.zeros(0, 5, dtype=torch.bfloat16), torch.zeros(0, 3))
    assert got.shape == (5, 3) and (got == 0).all()


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="lowrank_down: a must be"):
        lowrank_down(torch.randn(4, 5), torch.randn(3, 6))
    with pytest.raises(ValueError, match="lowrank_add_: expected h"):
        lowrank_add_(torch.randn(4, 5), torch.randn(4, 3), torch.randn(4, 3))
    with pytest.raises(ValueError, match="int64; expected float32"):
        lowrank_tokens(torch.zeros(4, 5, dtype=torch.int64), torch.randn(4, 3))


# in the LoRA ops: fp32 adapters on a bf16 base outside autocast ------------------------------------------
class _LargeFp32(TorchDispatchMode):
    """Records every fp32 [tokens, features] tensor of at least ``numel`` elements an op creates (an fp32 copy of
    an activation or of its gradient). ``tokens`` is no block size: the interpreter's own tensors are blocks."""

    def __init__(self, tokens, numel):
        super().__init__()
        self.tokens, self.numel, self.seen = tokens, numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= self.numel
                    and self.tokens in t.shape):
                self.seen.append((str(func), tuple(t.shape)))
        return out


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = {"down": 0, "add": 0, "tokens": 0}
    for name in calls:
        launch = getattr(lowrank_mod, f"_{name}_launch")

        def counted(*args, _launch=launch, _name=name):
            calls[_name] += 1
            return _launch(*args)

        monkeypatch.setattr(lowrank_mod, f"_{name}_launch", counted)
    return calls


def _fp64_copy(layer):
    return copy.deepcopy(layer).double()  # (a dropout module with a fixed mask keeps it)


def _check_against_peft_and_fp64(got, peft, exact):
    for g, p, e in zip(got, peft, exact):
        assert g.dtype == p.dtype and g.shape == p.shape
        err, peft_err = relative_error(g, e), relative_error(p, e)
        assert err <= 2 * peft_err + 1e-6, (err, peft_err)


@pytest.fixture(params=["lowrank", "torch"])
def path(request, monkeypatch):
    """foak.ops.lowrank's kernels, or torch's fp32-copy path (where lowrank.USE turns them off)."""
    monkeypatch.setitem(lowrank_mod.USE, "cpu", request.param == "lowrank")
    return request.param


@pytest.mark.parametrize(("path", "p", "dtype"), [
    ("lowrank", 0.0, torch.bfloat16), ("lowrank", 0.25, torch.bfloat16), ("lowrank", 0.25, torch.float16),
    ("torch", 0.0, torch.bfloat16), ("torch", 0.25, torch.bfloat16)], indirect=["path"])
def test_lora_linear_and_shared_input_projections(kernel_calls, p, dtype, path):
    # (an fp16 base, as with a GradScaler: the FMA dots, no bf16 split)
    tokens, in_f, outs, ranks = 70, 45, [38, 23], [5, 9]
    _, layers = _peft_layers(in_f, outs, ranks, alpha=8, bias=[True, False], base_dtype=dtype,
                             adapter_dtype=torch.float32)
    x = torch.randn(tokens, in_f).to(dtype)
    seeds = [torch.tensor([11]), torch.tensor([12])] if p else [None, None]
    if p:  # PEFT's layers drop out with foak's masks
        for layer, seed in zip(layers, seeds):
            _use_mask(layer, lora_dropout_mask(seed, x.shape, p), p)
    dys = [torch.randn(tokens, o).to(dtype) for o in outs]
    leaves = [t for layer in layers for t in (layer.lora_A["default"].weight, layer.lora_B["default"].weight)]

    def run(fn, x=x, dys=dys, leaves=leaves):
        xl = x.detach().requires_grad_()
        with _LargeFp32(tokens, tokens * min(in_f, *outs)) as mode:
            out = fn(xl)
            grads = torch.autograd.grad(out, [xl, *leaves], dys)
        return [*out, *grads], mode.seen

    peft, peft_copies = run(lambda t: [layer(t) for layer in layers])
    assert peft_copies  # PEFT's casts are what the mode sees
    layers64 = [_fp64_copy(layer) for layer in layers]
    leaves64 = [t for layer in layers64 for t in (layer.lora_A["default"].weight, layer.lora_B["default"].weight)]
    exact, _ = run(lambda t: [layer(t) for layer in layers64], x.double(), [d.double() for d in dys], leaves64)
    projections = [(*_args(layer), p, seed) for layer, seed in zip(layers, seeds)]
    got, copies = run(lambda t: lora_linears(t, projections))  # without dropout stacked: one down GEMM for both
    assert (copies == []) == (path == "lowrank")
    _check_against_peft_and_fp64(got, peft, exact)
    # the adapters' gradients: fp32 math on the same bf16 dy and x, as PEFT's
    for ours, theirs in zip(got[3:], peft[3:]):
        assert relative_error(ours, theirs) <= 1e-5
    if path == "torch":
        assert kernel_calls == {"down": 0, "add": 0, "tokens": 0}
    elif p == 0:  # forward: one down projection, an up projection per output; backward: per projection g and dB,
        # then dx's adapter part and dA once for the stacked adapters
        assert kernel_calls == {"down": 1 + 2, "add": 2 + 1, "tokens": 2 + 1}
    else:  # per projection: down and up; g, dB, dx's adapter part (masked), dA (masked)
        assert kernel_calls == {"down": 2 + 2, "add": 2 + 2, "tokens": 2 + 2}
    single, copies = run(lambda t: [lora_linear(t, *_args(layers[0]), dropout_p=p, seed=seeds[0])], dys=dys[:1],
                         leaves=leaves[:2])
    assert (copies == []) == (path == "lowrank")
    # (the input gradient above is both projections'; the single one's adapters and output compare)
    _check_against_peft_and_fp64([single[0], *single[2:]], [peft[0], *peft[3:5]], [exact[0], *exact[3:5]])


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_lora_glu_linear(kernel_calls, p, path):
    tokens, inter, out_f, r = 66, 70, 20, 6
    _, layer = _peft_layer(inter, out_f, r, bias=False, base_dtype=torch.bfloat16, adapter_dtype=torch.float32)
    g0, u0 = (torch.randn(tokens, inter).to(torch.bfloat16) for _ in range(2))
    seed = torch.tensor([21]) if p else None
    if p:
        _use_mask(layer, lora_dropout_mask(seed, (tokens, inter), p), p)
    dy = torch.randn(tokens, out_f).to(torch.bfloat16)

    def run(fn, dtype=torch.bfloat16, layer=layer):
        g, u = g0.to(dtype).requires_grad_(), u0.to(dtype).requires_grad_()
        with _LargeFp32(tokens, tokens * out_f) as mode:
            out = fn(g * 1, u * 1, layer)
            grads = torch.autograd.grad(out, (g, u, layer.lora_A["default"].weight, layer.lora_B["default"].weight),
                                        dy.to(dtype))
        return [out, *grads], mode.seen

    def peft_fn(g, u, layer):
        return layer(nn.functional.silu(g) * u)

    peft, peft_copies = run(peft_fn)
    assert peft_copies
    exact, _ = run(peft_fn, torch.float64, _fp64_copy(layer))
    got, copies = run(lambda g, u, layer: lora_glu_linear(g, u, *_args(layer), dropout_p=p, seed=seed))
    assert (copies == []) == (path == "lowrank")
    _check_against_peft_and_fp64(got, peft, exact)
    assert kernel_calls == ({"down": 2, "add": 2, "tokens": 2} if path == "lowrank" else
                            {"down": 0, "add": 0, "tokens": 0})


def test_custom_ops_pass_opcheck_and_compile_fullgraph():
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    x, a, h = torch.randn(9, 20).to(torch.bfloat16), torch.randn(3, 20), torch.randn(9, 3)
    for seed, p in ((None, 0.0), (torch.tensor([7]), 0.2)):
        torch.library.opcheck(torch.ops.foak.lowrank_down, (x, a, 0.5, seed, p), test_utils=tests)
        torch.library.opcheck(torch.ops.foak.lowrank_add, (x.clone(), h, a, 0.5, True, seed, p), test_utils=tests)
        torch.library.opcheck(torch.ops.foak.lowrank_tokens, (x, h, 2.0, seed, p), test_utils=tests)
    # a LoRA projection with fp32 adapters on a bf16 base, compiled whole (forward and backward)
    torch._dynamo.reset()
    _, layer = _peft_layer(37, 19, 7, bias=True, base_dtype=torch.bfloat16, adapter_dtype=torch.float32)
    weight, bias, lora_a, lora_b, s = _args(layer)
    x = torch.randn(2, 6, 37).to(torch.bfloat16).requires_grad_()

    def step(x, a, b):
        return lora_linear(x, weight, bias, a, b, s)

    out = torch.compile(step, fullgraph=True)(x, lora_a, lora_b)
    grads = torch.autograd.grad(out.float().square().sum(), (x, lora_a, lora_b))
    ref = step(x, lora_a, lora_b)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (x, lora_a, lora_b))
    assert torch.equal(out, ref) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize(("m", "k", "n", "r"), [(70, 130, 66, 7), (9, 10, 5, 3)])
def test_dropout_mask_is_lora_dropouts(m, k, n, r, split):
    # the kernels' tiles of the mask are foak.ops.lora's mask (a row at a time there): the same elements dropped
    from foak.ops.lora import lora_dropout_mask
    from foak.ops.lowrank import (
        lowrank_add_reference,
        lowrank_down_reference,
        lowrank_tokens_reference,
    )

    seed, p = torch.tensor([123]), 0.3
    x, a = torch.randn(m, k).to(torch.bfloat16), torch.randn(r, k)
    keep_x = lora_dropout_mask(seed, (m, k), p)
    dropped = torch.where(keep_x, x.double() / (1 - p), 0.0)
    got = lowrank_down(x, a, 0.5, keep=(seed, p))
    assert relative_error(got, 0.5 * dropped @ a.double().t()) <= 1e-6
    assert relative_error(lowrank_down_reference(x, a, 0.5, keep=(seed, p)), got) <= 1e-6
    g = torch.randn(m, r)
    got = lowrank_tokens(x, g, 2.0, keep=(seed, p))
    assert relative_error(got, 2.0 * dropped.t() @ g.double()) <= 1e-6
    assert relative_error(lowrank_tokens_reference(x, g, 2.0, keep=(seed, p)), got) <= 1e-6
    out, b = torch.randn(m, n).to(torch.bfloat16), torch.randn(n, r)
    keep_out = lora_dropout_mask(seed, (m, n), p)
    exact = out.double() + torch.where(keep_out, 0.5 * g.double() @ b.double().t() / (1 - p), 0.0)
    got = lowrank_add_(out.clone(), g, b, 0.5, keep=(seed, p))
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    torch.testing.assert_close(lowrank_add_reference(out.clone(), g, b, 0.5, keep=(seed, p)), got, rtol=0,
                               atol=2**-7 * exact.abs().max().item())
    with pytest.raises(ValueError, match="seed must be a one-element int64 tensor"):
        lowrank_down(x, a, keep=(5, p))
    with pytest.raises(ValueError, match=r"probability must be in \(0, 1\)"):
        lowrank_down(x, a, keep=(seed, 1.0))
