"""foak.ops.moe.moe_experts in the Triton interpreter (combine kernels, GLU kernel; per-expert GEMMs on the
CPU) against transformers' eager MixtralExperts at the same dtype and an fp64 loop: forward and the
gradients of hidden states, routing weights and both weight tensors; k = 1, 2 and E; experts without
tokens; one token; GeGLU; autocast over fp32 weights; the errors."""

import pytest
import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from foak.ops import moe as moe_mod
from foak.ops.moe import moe_experts, moe_experts_reference

E, H, INTER = 4, 48, 80


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setitem(moe_mod.TUNING, "block_h", 32)  # H = 48: a full and a partial column block


def experts(dtype=torch.float32, act="silu"):
    cfg = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=2,
                        hidden_act=act)
    cfg._experts_implementation = "eager"
    module = MixtralExperts(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=g) * 0.1)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=g) * 0.1)
    return module.to(dtype)


def routing(T, k, allowed=None, dtype=torch.float32):
    logits = torch.randn(T, E)
    if allowed is not None:  # the other experts get no token
        logits[:, [e for e in range(E) if e not in allowed]] = -float("inf")
    w, idx = torch.topk(logits.softmax(-1), k, dim=-1)
    return idx, (w / w.sum(-1, keepdim=True)).to(dtype)


def run(fn, x, w, module):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = fn(x, w)
    grads = torch.autograd.grad(y, (x, w, module.gate_up_proj, module.down_proj), torch.ones_like(y) * 0.5
                                + torch.linspace(-1, 1, y.numel()).view_as(y).to(y.dtype))
    return (y, *grads)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("T,k,allowed", [(37, 2, None), (37, 1, None), (37, E, None), (37, 2, (0, 2)), (1, 2, None)],
                         ids=["k2", "k1", "kE", "empty-experts", "one-token"])
def test_fp32_matches_eager_and_fp64(T, k, allowed):
    module = experts()
    idx, w = routing(T, k, allowed)
    x = torch.randn(T, H)
    ours = run(lambda x, w: moe_experts(x, idx, w, module.gate_up_proj, module.down_proj), x, w, module)
    eager = run(lambda x, w: module(x, idx, w), x, w, module)
    m64 = experts(torch.float64)
    exact = run(lambda x, w: moe_experts_reference(x, idx, w, m64.gate_up_proj, m64.down_proj), x.double(),
                w.double(), m64)
    names = ("out", "d_hidden", "d_weights", "d_gate_up", "d_down")
    for name, a, b, c in zip(names, ours, eager, exact):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel(a, b) <= 1e-5, (name, rel(a, b))
        assert rel(a, c) <= 1e-5, (name, rel(a, c))
    if allowed is not None:  # experts without tokens get exactly zero gradients
        for e in set(range(E)) - set(allowed):
            assert torch.count_nonzero(ours[3][e]) == 0 and torch.count_nonzero(ours[4][e]) == 0


def test_bf16_matches_eager():
    module = experts(torch.bfloat16)
    idx, w = routing(37, 2, dtype=torch.bfloat16)
    x = torch.randn(37, H).to(torch.bfloat16)
    ours = run(lambda x, w: moe_experts(x, idx, w, module.gate_up_proj, module.down_proj), x, w, module)
    eager = run(lambda x, w: module(x, idx, w), x, w, module)
    for name, a, b in zip(("out", "d_hidden", "d_weights", "d_gate_up", "d_down"), ours, eager):
        assert a.dtype == torch.bfloat16, name
        assert rel(a, b) <= 2e-2, (name, rel(a, b))


def test_geglu_and_kernel_launches(monkeypatch):
    calls = {"glu": 0, "combine": 0}
    glu, combine = moe_mod._glu_forward_op, moe_mod._combine

    def count(key, fn):
        def wrapped(*a, **kw):
            calls[key] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(moe_mod, "_glu_forward_op", count("glu", glu))
    monkeypatch.setattr(moe_mod, "_combine", count("combine", combine))
    module = experts(act="gelu_pytorch_tanh")
    idx, w = routing(37, 2)
    x = torch.randn(37, H)
    ours = run(lambda x, w: moe_experts(x, idx, w, module.gate_up_proj, module.down_proj, "gelu_tanh"), x, w,
               module)
    assert calls == {"glu": 1, "combine": 2}  # forward GLU; combine in the forward and for d_hidden
    eager = run(lambda x, w: module(x, idx, w), x, w, module)
    for name, a, b in zip(("out", "d_hidden", "d_weights", "d_gate_up", "d_down"), ours, eager):
        assert rel(a, b) <= 1e-5, (name, rel(a, b))


def test_autocast_over_fp32_weights():
    module = experts()
    idx, w = routing(37, 2)
    x = torch.randn(37, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = run(lambda x, w: moe_experts(x, idx, w, module.gate_up_proj, module.down_proj), x, w, module)
        eager = run(lambda x, w: module(x, idx, w), x, w, module)
    assert ours[0].dtype == eager[0].dtype == torch.float32 and ours[3].dtype == torch.float32 and ours[4].dtype == torch.float32
    for name, a, b in zip(("out", "d_hidden", "d_weights", "d_gate_up", "d_down"), ours, eager):
        assert rel(a, b) <= 2e-2, (name, rel(a, b))


def test_errors():
    module = experts()
    idx, w = routing(5, 2)
    x = torch.randn(5, H)
    gu, dn = module.gate_up_proj, module.down_proj
    with pytest.raises(ValueError, match="activation"):
        moe_experts(x, idx, w, gu, dn, "relu")
    with pytest.raises(ValueError, match=r"\[E, 2I, H=48\]"):
        moe_experts(x, idx, w, gu.transpose(1, 2), dn)
    with pytest.raises(ValueError, match="tokens=5, k"):
        moe_experts(x, idx[:4], w[:4], gu, dn)
    with pytest.raises(ValueError, match="share a dtype"):
        moe_experts(x.double(), idx, w, gu, dn)
    with pytest.raises((IndexError, RuntimeError)):
        moe_experts(x, torch.full_like(idx, E), w, gu, dn)  # expert id out of range


def test_second_backward_is_an_error():
    module = experts()
    idx, w = routing(9, 2)
    x = torch.randn(9, H, requires_grad=True)
    y = moe_experts(x, idx, w, module.gate_up_proj, module.down_proj)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        y.sum().backward()


def test_recompute_h_same_gradients():
    """recompute_h=True keeps no [S, 2I] tensor and recomputes it in the backward: the same numbers."""
    module = experts()
    idx, w = routing(37, 2, allowed=(0, 1, 3))
    x = torch.randn(37, H)
    kept = run(lambda x, w: moe_experts(x, idx, w, module.gate_up_proj, module.down_proj), x, w, module)
    again = run(lambda x, w: moe_experts(x, idx, w, module.gate_up_proj, module.down_proj, recompute_h=True), x, w,
                module)
    for name, a, b in zip(("out", "d_hidden", "d_weights", "d_gate_up", "d_down"), again, kept):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend, recompute_h", [("triton", True), ("reference", False)])
def test_torch_compile_fullgraph_matches_eager(backend, recompute_h):
    """Compiled (fullgraph, aot_eager): the GEMM loop, GLU and combine run as custom ops (the group sizes read
    when the op runs, no graph break), the backward into new buffers; the reference backend's GLU gradient
    (autograd inside its custom op) too."""
    import foak

    module = experts()
    idx, w = routing(37, 2, allowed=(0, 1, 3))  # expert 2 gets no token
    x = torch.randn(37, H)

    def fn(x, w):
        return moe_experts(x, idx, w, module.gate_up_proj, module.down_proj, "silu", recompute_h=recompute_h)

    foak.set_backend(backend)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        ours = run(compiled, x, w, module)
    finally:
        foak.set_backend("auto")
    eager = run(lambda x, w: module(x, idx, w), x, w, module)
    for name, a, b in zip(("out", "d_hidden", "d_weights", "d_gate_up", "d_down"), ours, eager):
        assert rel(a, b) <= 1e-5, (name, rel(a, b))
    assert torch.count_nonzero(ours[3][2]) == 0 and torch.count_nonzero(ours[4][2]) == 0
