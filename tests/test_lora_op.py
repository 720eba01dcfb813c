"""foak.ops.lora (plain base) against real PEFT lora.Linear modules (peft 0.21), in the Triton interpreter."""

import copy
import gc

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import foak
from foak.ops import lora as lora_mod
from foak.ops.lora import (
    lora_dropout_mask,
    lora_dropout_mask_reference,
    lora_dropout_seed,
    lora_linear,
    lora_linear_reference,
    lora_linears,
)
from foak.testing import relative_error


@pytest.fixture
def auto_backend():
    yield
    foak.set_backend("auto")


@pytest.fixture(autouse=True)
def _seed(request):
    """conftest's _seed, with its full garbage collection (~0.2 s) only before the tests that trace (the
    finalizers of other tests' patched models must not run inside a trace); the others patch no model."""
    if request.node.originalname in ("test_torch_compile_fullgraph_with_dropout", "test_dropout_custom_ops_pass_opcheck"):
        gc.collect()
    torch.manual_seed(1234)


class _Tiny(nn.Module):
    def __init__(self, in_f, outs, bias):
        super().__init__()
        self.names = [f"proj{i}" for i in range(len(outs))]
        for name, out_f, b in zip(self.names, outs, bias):
            setattr(self, name, nn.Linear(in_f, out_f, bias=b))


def _peft_layers(in_f, outs, ranks, alpha=16, dropout=0.0, bias=True, rslora=False, base_dtype=torch.float32,
                 adapter_dtype=None):
    """PEFT lora.Linear layers (one per entry of ``outs``) over one tiny model, random B (not zero)."""
    bias = bias if isinstance(bias, (list, tuple)) else [bias] * len(outs)
    model = _Tiny(in_f, outs, bias).to(base_dtype)
    config = LoraConfig(r=ranks[0], lora_alpha=alpha, lora_dropout=dropout, target_modules=model.names,
                        init_lora_weights=False, use_rslora=rslora,
                        rank_pattern={name: r for name, r in zip(model.names, ranks)})
    peft_model = get_peft_model(model, config, autocast_adapter_dtype=False)
    layers = [getattr(peft_model.base_model.model, name) for name in model.names]
    for layer in layers:
        for module in (layer.lora_A["default"], layer.lora_B["default"]):
            module.to(adapter_dtype or base_dtype)
    return peft_model, layers


def _peft_layer(in_f, out_f, r, **kwargs):
    peft_model, (layer,) = _peft_layers(in_f, [out_f], [r], **kwargs)
    return peft_model, layer


def _args(layer):
    return (layer.base_layer.weight, layer.base_layer.bias, layer.lora_A["default"].weight,
            layer.lora_B["default"].weight, layer.scaling["default"])


class _FixedMaskDropout(nn.Module):
    """PEFT's dropout with a given keep mask (inverted dropout: kept values times 1/(1-p))."""

    def __init__(self, keep, p):
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, x):
        return torch.where(self.keep.view(x.shape), x * (1.0 / (1.0 - self.p)), torch.zeros((), dtype=x.dtype))


def _use_mask(layer, keep, p):
    layer.lora_dropout["default"] = _FixedMaskDropout(keep, p)


def _grads(out, leaves, dy):
    return torch.autograd.grad(out, leaves, dy)


def _run(fn, x, layer, dy):
    """Output and (dx, dA, dB) of ``fn(x)``; x is a fresh leaf each time."""
    x = x.detach().requires_grad_()
    out = fn(x)
    return out, _grads(out, (x, layer.lora_A["default"].weight, layer.lora_B["default"].weight), dy)


def _compare(out, grads, ref_out, ref_grads, tol):
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    errors = [relative_error(out, ref_out)] + [relative_error(g, r) for g, r in zip(grads, ref_grads)]
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype, (g.dtype, r.dtype)
    assert max(errors) <= tol, errors
    return errors


# fp32 vs PEFT ---------------------------------------------------------------------------------------
CASES = [  # (x shape, out, r, bias, dropout, rslora)
    ((13, 37), 19, 7, True, 0.0, False),
    ((2, 5, 37), 19, 13, False, 0.25, True),
    ((6, 1100), 9, 7, True, 0.1, False),  # 1100 columns: more than one kernel block per row
    ((37,), 5, 3, False, 0.5, False),  # 1-d input, as nn.Linear accepts
]


@pytest.mark.parametrize(("shape", "out_f", "r", "bias", "p", "rslora"), CASES)
def test_fp32_matches_peft(shape, out_f, r, bias, p, rslora):
    in_f = shape[-1]
    _, layer = _peft_layer(in_f, out_f, r, alpha=11, dropout=p, bias=bias, rslora=rslora)
    assert layer.scaling["default"] == (11 / r**0.5 if rslora else 11 / r)
    x = torch.randn(shape)
    seed = 4242
    if p > 0:
        _use_mask(layer, lora_dropout_mask(seed, shape, p), p)
    dy = torch.randn(*shape[:-1], out_f)
    ref_out, ref_grads = _run(layer, x, layer, dy)
    out, grads = _run(lambda t: lora_linear(t, *_args(layer), dropout_p=p, seed=seed), x, layer, dy)
    _compare(out, grads, ref_out, ref_grads, 1e-5)
    assert relative_error(layer.base_layer(x), ref_out) > 1e-2  # the adapter's part is not negligible


@pytest.mark.parametrize("layout", ["transposed", "row_strided"])
def test_non_contiguous_input(layout):
    _, layer = _peft_layer(29, 11, 5, dropout=0.2)
    base = torch.randn(29, 14) if layout == "transposed" else torch.randn(14, 64)
    x = base.t() if layout == "transposed" else base[:, 3:32]
    assert not x.is_contiguous() and x.shape == (14, 29)
    seed = 7
    _use_mask(layer, lora_dropout_mask(seed, x.shape, 0.2), 0.2)
    dy = torch.randn(14, 11)
    ref_out, ref_grads = _run(layer, x, layer, dy)
    out, grads = _run(lambda t: lora_linear(t, *_args(layer), dropout_p=0.2, seed=seed), x, layer, dy)
    _compare(out, grads, ref_out, ref_grads, 1e-5)


# bf16 and autocast ----------------------------------------------------------------------------------
def _fp32_copy(layer):
    ref = copy.deepcopy(layer).float()
    return ref


def _use_same_mask(layers, seed, shape, p):
    """With dropout, every PEFT layer applies the mask foak draws from ``seed`` (nothing to do for p=0)."""
    if p > 0:
        keep = lora_dropout_mask(seed, shape, p)
        for layer in layers:
            _use_mask(layer, keep, p)


@pytest.mark.parametrize(("p", "bias"), [(0.0, True), (0.3, False)])
def test_bf16_within_twice_peft_error(p, bias):
    _, layer = _peft_layer(45, 23, 7, dropout=p, bias=bias, base_dtype=torch.bfloat16)
    assert layer.lora_A["default"].weight.dtype == torch.bfloat16
    layer32 = _fp32_copy(layer)
    x = torch.randn(3, 9, 45).to(torch.bfloat16)
    seed = 99
    _use_same_mask((layer, layer32), seed, x.shape, p)
    dy = torch.randn(3, 9, 23).to(torch.bfloat16)
    peft_out, peft_grads = _run(layer, x, layer, dy)
    ref_out, ref_grads = _run(layer32, x.float(), layer32, dy.float())
    out, grads = _run(lambda t: lora_linear(t, *_args(layer), dropout_p=p, seed=seed), x, layer, dy)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    for name, got, own, ref in zip(["out", "dx", "dA", "dB"], [out, *grads], [peft_out, *peft_grads],
                                   [ref_out, *ref_grads]):
        err, peft_err = relative_error(got, ref), relative_error(own, ref)
        assert err <= 2e-2 and err <= 2 * peft_err, (name, err, peft_err)


@pytest.mark.parametrize(("x_dtype", "p"), [(torch.bfloat16, 0.0), (torch.bfloat16, 0.2), (torch.float32, 0.2)])
def test_fp32_adapters_under_cpu_autocast(x_dtype, p):
    # what HF Trainer(bf16=True) + PEFT run: fp32 adapters, bf16 (or fp32) base, bf16 autocast
    base_dtype = x_dtype
    _, layer = _peft_layer(45, 23, 13, dropout=p, base_dtype=base_dtype, adapter_dtype=torch.float32)
    layer32 = _fp32_copy(layer)
    x = torch.randn(2, 7, 45).to(x_dtype)
    seed = 5
    _use_same_mask((layer, layer32), seed, x.shape, p)
    dy = torch.randn(2, 7, 23).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        peft_out, peft_grads = _run(layer, x, layer, dy)
        out, grads = _run(lambda t: lora_linear(t, *_args(layer), dropout_p=p, seed=seed), x, layer, dy)
    ref_out, ref_grads = _run(layer32, x.float(), layer32, dy.float())
    assert out.dtype == peft_out.dtype == torch.bfloat16
    assert [g.dtype for g in grads] == [g.dtype for g in peft_grads] == [x_dtype, torch.float32, torch.float32]
    for name, got, own, ref in zip(["out", "dx", "dA", "dB"], [out, *grads], [peft_out, *peft_grads],
                                   [ref_out, *ref_grads]):
        err, peft_err = relative_error(got, ref), relative_error(own, ref)
        assert err <= 2e-2 and err <= 2 * peft_err, (name, err, peft_err)
        assert relative_error(got, own) <= 2e-2, name


@pytest.mark.parametrize("lowrank_kernels", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_bf16_base_with_fp32_adapters_without_autocast(p, lowrank_kernels, monkeypatch):
    # foak.ops.lowrank's kernels, and torch's fp32-copy path (where they are off: CUDA until their GPU check)
    from foak.ops import lowrank

    monkeypatch.setitem(lowrank.USE, "cpu", lowrank_kernels)
    # PEFT casts x to the adapters' fp32, adds in fp32 and casts the sum back to bf16
    _, layer = _peft_layer(33, 17, 7, dropout=p, base_dtype=torch.bfloat16, adapter_dtype=torch.float32)
    x = torch.randn(11, 33).to(torch.bfloat16)
    seed = 3
    if p > 0:
        _use_mask(layer, lora_dropout_mask(seed, x.shape, p), p)
    dy = torch.randn(11, 17).to(torch.bfloat16)
    ref_out, ref_grads = _run(layer, x, layer, dy)
    out, grads = _run(lambda t: lora_linear(t, *_args(layer), dropout_p=p, seed=seed), x, layer, dy)
    # the adapter path runs in fp32 in both; only the bf16 base GEMMs and the final rounding differ
    _compare(out, grads, ref_out, ref_grads, 8e-3)
    assert relative_error(grads[1], ref_grads[1]) <= 1e-5 and relative_error(grads[2], ref_grads[2]) <= 1e-5


# the dropout mask -----------------------------------------------------------------------------------
def test_mask_keep_fraction_and_kernel_equals_torch_philox():
    for p in (0.1, 0.5):
        keep = lora_dropout_mask(11, (16, 257), p)  # the kernel (the interpreter's Philox: ~20 ms a row)
        assert keep.dtype == torch.bool and keep.shape == (16, 257)
        # the kernel's bits are Philox-4x32-10 of the element position, as the torch reference computes them;
        # the reference's first 16 of 64 rows are the kernel's, and its 64 rows keep 1 - p of the elements
        reference = lora_dropout_mask_reference(torch.tensor([11]), 64, 257, p)
        assert torch.equal(keep, reference[:16])
        assert abs(reference.float().mean().item() - (1 - p)) < 0.02
        assert abs(keep.float().mean().item() - (1 - p)) < 0.04
    assert not torch.equal(lora_dropout_mask(11, (16, 257), 0.5), lora_dropout_mask(12, (16, 257), 0.5))
    # a seed above 2**32 uses the high key word
    assert not torch.equal(lora_dropout_mask(11, (8, 64), 0.5), lora_dropout_mask(11 + 2**32, (8, 64), 0.5))
    assert lora_dropout_mask(3, (4, 5), 0.0).all()


def test_mask_does_not_depend_on_the_block_size(monkeypatch):
    keep = lora_dropout_mask(21, (5, 1037), 0.3)  # 260 quads a row: blocks of 256 + 4 (a partial quad at its end)
    monkeypatch.setitem(lora_mod.TUNING, "quads", 128)  # 128 + 128 + 4 (quads=4 took 65 programs a row)
    assert torch.equal(keep, lora_dropout_mask(21, (5, 1037), 0.3))
    # leading dims flatten into rows
    assert torch.equal(lora_dropout_mask(21, (5, 1, 1037), 0.3).view(5, 1037), keep)


def test_forward_and_backward_use_the_same_mask():
    # zero base weight: dx is the adapter's part only, s * mask / (1 - p) * (dy B A), zero exactly where dropped
    in_f, out_f, r, p, seed = 53, 17, 7, 0.4, 77
    x = torch.randn(19, in_f, requires_grad=True)
    weight, a, b = torch.zeros(out_f, in_f), torch.randn(r, in_f, requires_grad=True), torch.randn(out_f, r)
    out = lora_linear(x, weight, None, a, b, 2.0, dropout_p=p, seed=seed)
    dy = torch.randn_like(out)
    dx, da = torch.autograd.grad(out, (x, a), dy)
    keep = lora_dropout_mask(seed, x.shape, p)
    assert torch.equal(dx != 0, keep)
    xd = torch.where(keep, x.detach() / (1 - p), 0.0)
    assert relative_error(out, 2.0 * (xd @ a.t()) @ b.t()) < 1e-6
    assert relative_error(da, 2.0 * (dy @ b).t() @ xd) < 1e-6


def test_seed_none_draws_from_torch_generator():
    _, layer = _peft_layer(31, 7, 5)
    x = torch.randn(9, 31)
    torch.manual_seed(2024)
    expected_seed = lora_dropout_seed("cpu")
    torch.manual_seed(2024)
    out1 = lora_linear(x, *_args(layer), dropout_p=0.3)
    torch.manual_seed(2024)
    out2 = lora_linear(x, *_args(layer), dropout_p=0.3)
    out3 = lora_linear(x, *_args(layer), dropout_p=0.3)
    assert torch.equal(out1, out2) and not torch.equal(out1, out3)
    assert torch.equal(out1, lora_linear(x, *_args(layer), dropout_p=0.3, seed=expected_seed))
    assert torch.equal(out1, lora_linear(x, *_args(layer), dropout_p=0.3, seed=int(expected_seed)))


def test_reference_backend_gives_the_same_function(auto_backend):
    _, layer = _peft_layer(41, 13, 7, bias=True)
    x = torch.randn(2, 6, 41)
    dy = torch.randn(2, 6, 13)
    out, grads = _run(lambda t: lora_linear(t, *_args(layer), dropout_p=0.35, seed=8), x, layer, dy)
    foak.set_backend("reference")
    ref_out, ref_grads = _run(lambda t: lora_linear(t, *_args(layer), dropout_p=0.35, seed=8), x, layer, dy)
    assert lora_mod.use_triton(x.device) is False
    _compare(out, grads, ref_out, ref_grads, 1e-6)
    direct = lora_linear_reference(x, *_args(layer), dropout_p=0.35, seed=8)
    assert torch.equal(direct, ref_out)


# gradients: which ones, frozen base ---------------------------------------------------------------
def test_frozen_base_and_needed_gradients_only():
    _, layer = _peft_layer(23, 9, 5, dropout=0.1)
    weight, bias, a, b, s = _args(layer)
    x = torch.randn(4, 23)  # no grad for x (e.g. the first layer's normed embeddings)
    out = lora_linear(x, weight, bias, a, b, s, dropout_p=0.1, seed=1)
    out.sum().backward()
    assert a.grad is not None and b.grad is not None and weight.grad is None and bias.grad is None
    a.grad = b.grad = None
    b.requires_grad_(False)
    x.requires_grad_()
    out = lora_linear(x, weight, bias, a, b, s, dropout_p=0.1, seed=1)
    dx, da = torch.autograd.grad(out.sum(), (x, a))
    ref = lora_linear_reference(x, weight, bias, a, b, s, dropout_p=0.1, seed=1)
    rdx, rda = torch.autograd.grad(ref.sum(), (x, a))
    assert relative_error(dx, rdx) < 1e-6 and relative_error(da, rda) < 1e-6


def test_empty_batch():
    _, layer = _peft_layer(23, 9, 5)
    x = torch.randn(0, 23, requires_grad=True)
    out = lora_linear(x, *_args(layer), dropout_p=0.2, seed=1)
    assert out.shape == (0, 9)
    out.sum().backward()
    assert x.grad.shape == (0, 23) and torch.equal(layer.lora_A["default"].weight.grad, torch.zeros(5, 23))


# saved memory -------------------------------------------------------------------------------------
def _saved_bytes(fn, params):
    """Bytes of the distinct non-parameter storages autograd saves while ``fn`` runs."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params if p is not None}
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


MEMORY_CASES = [  # (base dtype, adapter dtype, autocast, p)
    (torch.float32, torch.float32, False, 0.0),
    (torch.float32, torch.float32, False, 0.1),
    (torch.bfloat16, torch.bfloat16, False, 0.1),
    (torch.bfloat16, torch.float32, False, 0.1),
    (torch.bfloat16, torch.float32, True, 0.1),
    (torch.bfloat16, torch.float32, True, 0.0),
]


@pytest.mark.parametrize(("base_dtype", "adapter_dtype", "autocast", "p"), MEMORY_CASES)
def test_saves_x_and_the_rank_sized_product_only(base_dtype, adapter_dtype, autocast, p):
    tokens, in_f, out_f, r = 32, 96, 40, 8
    _, layer = _peft_layer(in_f, out_f, r, dropout=p, base_dtype=base_dtype, adapter_dtype=adapter_dtype)
    layer.train()
    x = torch.randn(tokens, in_f).to(base_dtype).requires_grad_()
    params = list(_args(layer)[:4])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, peft_bytes = _saved_bytes(lambda: layer(x), params)
        _, foak_bytes = _saved_bytes(lambda: lora_linear(x, *_args(layer), dropout_p=p, seed=1), params)
    compute = torch.bfloat16 if autocast else adapter_dtype
    x_bytes = x.numel() * x.element_size()
    h_bytes = tokens * r * compute.itemsize
    adapter_casts = (r * in_f + out_f * r) * 2 if autocast else 0  # autocast's bf16 copies of A and B (PEFT too)
    assert foak_bytes <= x_bytes + h_bytes + 8 + adapter_casts
    assert foak_bytes <= peft_bytes
    if p > 0 or (adapter_dtype != base_dtype and not autocast):
        assert foak_bytes < 0.6 * peft_bytes
    print(f"saved bytes {base_dtype}/{adapter_dtype} autocast={autocast} p={p}: foak {foak_bytes}, "
          f"peft {peft_bytes}, ratio {foak_bytes / peft_bytes:.2f}")


# shared input: q, k, v ------------------------------------------------------------------------------
@pytest.mark.parametrize("dropouts", [(0.0, 0.0, 0.0), (0.1, 0.0, 0.3)])
def test_lora_linears_match_peft_q_k_v(dropouts):
    in_f, outs, ranks = 37, [21, 9, 9], [7, 13, 5]
    peft_model, layers = _peft_layers(in_f, outs, ranks, alpha=8, bias=[True, False, True], dropout=0.2)
    x = torch.randn(2, 5, in_f)
    seeds = [10, 11, 12]
    for layer, p, seed in zip(layers, dropouts, seeds):
        if p > 0:
            _use_mask(layer, lora_dropout_mask(seed, x.shape, p), p)
        else:
            layer.lora_dropout["default"] = nn.Identity()
    dys = [torch.randn(2, 5, o) for o in outs]
    leaves = [t for layer in layers for t in (layer.lora_A["default"].weight, layer.lora_B["default"].weight)]

    def run(fn):
        xl = x.detach().requires_grad_()
        outs_ = fn(xl)
        return outs_, torch.autograd.grad(outs_, [xl, *leaves], dys)

    ref_outs, ref_grads = run(lambda t: [layer(t) for layer in layers])
    projections = [(*_args(layer), p, seed) for layer, p, seed in zip(layers, dropouts, seeds)]
    got_outs, got_grads = run(lambda t: lora_linears(t, projections))
    for got, ref in zip([*got_outs, *got_grads], [*ref_outs, *ref_grads]):
        assert got.shape == ref.shape and relative_error(got, ref) <= 1e-5
    # x is saved once
    params = [t for layer in layers for t in _args(layer)[:4]]
    xl = x.detach().requires_grad_()
    _, peft_bytes = _saved_bytes(lambda: [layer(xl) for layer in layers], params)
    _, foak_bytes = _saved_bytes(lambda: lora_linears(xl, projections), params)
    assert foak_bytes <= x.numel() * 4 + sum(ranks) * 10 * 4 + 8 * 3
    print(f"q,k,v saved bytes p={dropouts}: foak {foak_bytes}, peft {peft_bytes}")


def test_lora_linears_masks_are_independent():
    in_f = 40
    x = torch.randn(8, in_f)
    weight = torch.zeros(in_f, in_f)
    eye = torch.eye(in_f)
    # A = I, B = I, zero base: out_i = dropout_i(x) exactly
    projections = [(weight, None, eye, eye, 1.0, 0.5, None) for _ in range(3)]
    torch.manual_seed(0)
    outs = lora_linears(x, projections)
    masks = [o != 0 for o in outs]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    torch.manual_seed(0)
    seeds = [lora_dropout_seed("cpu") for _ in range(3)]
    for mask, seed in zip(masks, seeds):
        assert torch.equal(mask, lora_dropout_mask(seed, x.shape, 0.5))


# errors ---------------------------------------------------------------------------------------------
def test_clear_errors():
    weight, a, b = torch.randn(9, 23), torch.randn(5, 23), torch.randn(9, 5)
    x = torch.randn(4, 23)
    cases = [
        (dict(weight=weight.clone().requires_grad_()), "frozen in LoRA"),
        (dict(bias=torch.randn(9, requires_grad=True)), "frozen in LoRA"),
        (dict(lora_A=torch.randn(5, 22)), "lora_A must be"),
        (dict(lora_B=torch.randn(9, 4)), "lora_B must be"),
        (dict(weight=torch.randn(9, 22)), "weight must be"),
        (dict(bias=torch.randn(8)), "bias must be"),
        (dict(x=x.bfloat16()), "base GEMM needs one dtype"),
        (dict(lora_B=b.bfloat16()), "share one dtype"),
        (dict(x=torch.ones(4, 23, dtype=torch.int64)), "dtype"),
        (dict(dropout_p=1.0), "dropout_p"),
        (dict(dropout_p=-0.1), "dropout_p"),
        (dict(scaling="2"), "scaling"),
        (dict(scaling=float("nan")), "scaling"),
        (dict(dropout_p=0.1, seed=-1), "seed"),
        (dict(dropout_p=0.1, seed=torch.tensor([1.5])), "seed"),
    ]
    for override, message in cases:
        kwargs = dict(x=x, weight=weight, bias=None, lora_A=a, lora_B=b, scaling=2.0, dropout_p=0.0)
        kwargs.update(override)
        with pytest.raises(ValueError, match=message):
            lora_linear(**kwargs)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast"):
        lora_linear(x, weight, None, a.half(), b.half(), 2.0)
    with pytest.raises(ValueError, match="projections"):
        lora_linears(x, [])
    with pytest.raises(ValueError, match="projection 0"):
        lora_linears(x, [(weight, None, a, b, 2.0)])


def test_dropout_custom_ops_pass_opcheck():
    x, seed = torch.randn(6, 37), torch.tensor([5])
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(torch.ops.foak.lora_dropout, (x, seed, 0.3, torch.bfloat16), test_utils=tests)
    dxa, dx = torch.randn(6, 37), torch.randn(6, 37)
    torch.library.opcheck(torch.ops.foak.lora_dropout_backward, (x, dxa, dx, seed, 0.3, True), test_utils=tests)


def test_backward_inside_an_autocast_region_keeps_fp32():
    # forward outside autocast, backward called inside one (CPU runs the backward on this thread)
    _, layer = _peft_layer(29, 11, 5, dropout=0.2)
    x = torch.randn(7, 29)
    dy = torch.randn(7, 11)
    x_leaf = x.clone().requires_grad_()
    _use_mask(layer, lora_dropout_mask(1, x.shape, 0.2), 0.2)
    ref_out, ref_grads = _run(layer, x, layer, dy)
    out = lora_linear(x_leaf, *_args(layer), dropout_p=0.2, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grads = _grads(out, (x_leaf, layer.lora_A["default"].weight, layer.lora_B["default"].weight), dy)
    _compare(out, grads, ref_out, ref_grads, 1e-5)
    # the same for lora_linears
    outs = lora_linears(x_leaf, [(*_args(layer), 0.2, 1)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grads = _grads(outs[0], (x_leaf, layer.lora_A["default"].weight, layer.lora_B["default"].weight), dy)
    _compare(outs[0], grads, ref_out, ref_grads, 1e-5)


def test_torch_compile_fullgraph_with_dropout():
    # the dropout kernels are custom ops (the backward one mutates its buffers); a tensor seed or seed=None
    # (drawn inside the graph) does not recompile per step
    torch._dynamo.reset()
    _, layer = _peft_layer(37, 19, 7, bias=True)
    weight, bias, a, b, s = _args(layer)
    x = torch.randn(2, 6, 37, requires_grad=True)

    def step(x, a, b, seed):
        return lora_linear(x, weight, bias, a, b, s, dropout_p=0.3, seed=seed)

    compiled = torch.compile(step, fullgraph=True)
    for seed in (3, 4):
        out = compiled(x, a, b, torch.tensor([seed]))
        grads = torch.autograd.grad(out.square().sum(), (x, a, b))
        ref = lora_linear_reference(x, weight, bias, a, b, s, dropout_p=0.3, seed=seed)
        ref_grads = torch.autograd.grad(ref.square().sum(), (x, a, b))
        assert relative_error(out, ref) < 1e-6
        assert all(relative_error(g, r) < 1e-6 for g, r in zip(grads, ref_grads))
    drawn = torch.compile(lambda x: lora_linear(x, weight, bias, a, b, s, dropout_p=0.3), fullgraph=True)
    torch.manual_seed(5)
    first = drawn(x)
    torch.manual_seed(5)
    assert torch.equal(drawn(x), first) and not torch.equal(drawn(x), first)
