"""foak.ops.moe.moe_experts in the Triton interpreter (combine kernels, GLU kernel; per-expert GEMMs on the
CPU) against transformers' eager MixtralExperts at the same dtype and an fp64 loop: forward and the
gradients of hidden states, routing weights and both weight tensors; k = 1, 2 and E; experts without
tokens; one token; GeGLU; autocast over fp32 weights; the errors. gpt-oss's options (biases, transposed weights,
interleaved gate/up, clamped SwiGLU) against an independent fp64 loop written from its formula and against
transformers' GptOssExperts, fp32 and bf16, odd shapes, the clamp's zero gradient, compiled."""

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


# ---- gpt-oss's experts: biases, transposed weights, interleaved gate/up, clamped SwiGLU ------------------

ALPHA = 1.702


def gpt_oss_formula(x, idx, w, gu, dn, bg, bd, alpha, limit, interleaved=True, transposed=True):
    """An independent loop over (token, slot), written from transformers' GptOssExperts formula."""
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = (x[t] @ gu[e] if transposed else gu[e] @ x[t]) + bg[e]
            g, u = (h[0::2], h[1::2]) if interleaved else (h[: h.numel() // 2], h[h.numel() // 2:])
            if limit is None:  # plain SwiGLU
                a = g * torch.sigmoid(g) * u
            else:
                g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
                a = (u + 1) * (g * torch.sigmoid(alpha * g))
            y = (a @ dn[e] if transposed else dn[e] @ a) + bd[e]
            acc = acc + w[t, j] * y
        out.append(acc)
    return torch.stack(out)


def gpt_oss_params(E_, H_, I_, transposed=True, seed=3):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn((E_, H_, 2 * I_) if transposed else (E_, 2 * I_, H_), generator=g) * 0.15
    dn = torch.randn((E_, I_, H_) if transposed else (E_, H_, I_), generator=g) * 0.15
    return gu, dn, torch.randn(E_, 2 * I_, generator=g) * 0.3, torch.randn(E_, H_, generator=g) * 0.3


def grads_of(fn, tensors, seed=5):
    ts = [t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*ts)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.dtype)
    return (y, *torch.autograd.grad(y, ts, dy))


GPT_NAMES = ("out", "d_hidden", "d_weights", "d_gate_up", "d_down", "d_gate_up_bias", "d_down_bias")


@pytest.mark.parametrize("E_,H_,I_,T,k,interleaved,transposed",
                         [(3, 48, 40, 23, 2, True, True), (5, 33, 19, 7, 3, True, True),
                          (3, 40, 24, 11, 2, False, True), (3, 40, 24, 11, 2, True, False)],
                         ids=["gpt-oss", "odd-shapes", "concatenated", "not-transposed"])
def test_clamped_swiglu_fp32_matches_fp64_formula(E_, H_, I_, T, k, interleaved, transposed):
    gu, dn, bg, bd = gpt_oss_params(E_, H_, I_, transposed)
    x = torch.randn(T, H_)
    w = torch.rand(T, k)
    idx = torch.stack([torch.randperm(E_)[:k] for _ in range(T)])
    limit = 0.6  # about a third of the gate and up values are clamped (checked below)
    ours = grads_of(lambda *a: moe_experts(a[0], idx, a[1], a[2], a[3], "clamped_swiglu", gate_up_bias=a[4],
                                           down_bias=a[5], interleaved=interleaved, transposed=transposed,
                                           alpha=ALPHA, limit=limit), (x, w, gu, dn, bg, bd))
    exact = grads_of(lambda *a: gpt_oss_formula(a[0], idx, a[1], a[2], a[3], a[4], a[5], ALPHA, limit, interleaved,
                                                transposed), [t.double() for t in (x, w, gu, dn, bg, bd)])
    for name, a, b in zip(GPT_NAMES, ours, exact):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert rel(a, b) <= 1e-5, (name, rel(a, b))
    h = torch.einsum("th,ehi->tei", x, gu if transposed else gu.transpose(1, 2)) + bg
    g, u = (h[..., 0::2], h[..., 1::2]) if interleaved else h.chunk(2, -1)
    assert (g > limit).float().mean() > 0.15 and (u.abs() > limit).float().mean() > 0.3


def test_clamped_swiglu_matches_transformers_gpt_oss_experts():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=H, intermediate_size=INTER // 2, num_local_experts=E, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    module = GptOssExperts(cfg)
    module.limit = 0.6  # clamps active (transformers 5.17 fixes 7.0 in __init__; the attribute is what it reads)
    gu, dn, bg, bd = gpt_oss_params(E, H, INTER // 2)
    with torch.no_grad():
        for p, v in zip((module.gate_up_proj, module.down_proj, module.gate_up_proj_bias, module.down_proj_bias),
                        (gu, dn, bg, bd)):
            p.copy_(v)
    idx, w = routing(29, 2)
    x = torch.randn(29, H)
    params = (module.gate_up_proj, module.down_proj, module.gate_up_proj_bias, module.down_proj_bias)

    def run_all(fn):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xx, ww)
        return (y, *torch.autograd.grad(y, (xx, ww, *params), torch.linspace(-1, 1, y.numel()).view_as(y)))

    ours = run_all(lambda xx, ww: moe_experts(xx, idx, ww, module.gate_up_proj, module.down_proj, "clamped_swiglu",
                                              gate_up_bias=module.gate_up_proj_bias, down_bias=module.down_proj_bias,
                                              interleaved=True, transposed=True, alpha=module.alpha,
                                              limit=module.limit))
    eager = run_all(lambda xx, ww: module(xx, idx, ww))
    for name, a, b in zip(GPT_NAMES, ours, eager):
        assert rel(a, b) <= 1e-5, (name, rel(a, b))


def test_clamped_swiglu_bf16_matches_fp64_formula():
    gu, dn, bg, bd = gpt_oss_params(3, 40, 24)
    x = torch.randn(13, 40)
    w = torch.rand(13, 2)
    idx = torch.stack([torch.randperm(3)[:2] for _ in range(13)])
    ins = [t.to(torch.bfloat16) for t in (x, w, gu, dn, bg, bd)]
    ours = grads_of(lambda *a: moe_experts(a[0], idx, a[1], a[2], a[3], "clamped_swiglu", gate_up_bias=a[4],
                                           down_bias=a[5], interleaved=True, transposed=True, alpha=ALPHA,
                                           limit=0.6), ins)
    exact = grads_of(lambda *a: gpt_oss_formula(a[0], idx, a[1], a[2], a[3], a[4], a[5], ALPHA, 0.6),
                     [t.double() for t in ins])
    for name, a, b in zip(GPT_NAMES, ours, exact):
        assert a.dtype == torch.bfloat16, name
        assert rel(a, b) <= 3e-2, (name, rel(a, b))


def test_silu_with_biases_interleaved_transposed_fp32():
    """The layout and bias options with the plain SwiGLU gate (the interleaved-gate kernel's silu branch)."""
    gu, dn, bg, bd = gpt_oss_params(3, 40, 24)
    x, w = torch.randn(11, 40), torch.rand(11, 2)
    idx = torch.stack([torch.randperm(3)[:2] for _ in range(11)])
    ours = grads_of(lambda *a: moe_experts(a[0], idx, a[1], a[2], a[3], "silu", gate_up_bias=a[4], down_bias=a[5],
                                           interleaved=True, transposed=True), (x, w, gu, dn, bg, bd))
    exact = grads_of(lambda *a: gpt_oss_formula(a[0], idx, a[1], a[2], a[3], a[4], a[5], None, None),
                     [t.double() for t in (x, w, gu, dn, bg, bd)])
    for name, a, b in zip(GPT_NAMES, ours, exact):
        assert rel(a, b) <= 1e-5, (name, rel(a, b))


def test_clamp_gradient_is_zero_outside_the_range():
    """A gate column pushed above limit and up columns pushed beyond +-limit by their biases get exactly zero
    gradient (weights and biases); the boundary-free columns do not."""
    gu, dn, bg, bd = gpt_oss_params(1, 24, 8)
    bg[0, 2 * 1] = 50.0  # gate of column 1 above the limit (interleaved: gate 2j)
    bg[0, 2 * 3 + 1] = 50.0  # up of column 3 above +limit
    bg[0, 2 * 5 + 1] = -50.0  # up of column 5 below -limit
    x = torch.randn(9, 24)
    idx = torch.zeros(9, 1, dtype=torch.int64)
    w = torch.ones(9, 1)
    ours = grads_of(lambda *a: moe_experts(a[0], idx, a[1], a[2], a[3], "clamped_swiglu", gate_up_bias=a[4],
                                           down_bias=a[5], interleaved=True, transposed=True, alpha=ALPHA,
                                           limit=7.0), (x, w, gu, dn, bg, bd))
    d_gu, d_bg = ours[3], ours[5]
    for col in (2 * 1, 2 * 3 + 1, 2 * 5 + 1):
        assert d_bg[0, col] == 0 and torch.count_nonzero(d_gu[0, :, col]) == 0, col
    for col in (0, 2 * 1 + 1, 2 * 3, 2 * 5):  # their partners and an unclamped gate
        assert d_bg[0, col] != 0 and torch.count_nonzero(d_gu[0, :, col]) == 24, col


def test_gpt_oss_option_errors():
    gu, dn, bg, bd = gpt_oss_params(3, 16, 5)
    x, w = torch.randn(5, 16), torch.rand(5, 2)
    idx = torch.zeros(5, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="needs a finite number alpha"):
        moe_experts(x, idx, w, gu, dn, "clamped_swiglu", transposed=True, limit=7.0)
    with pytest.raises(ValueError, match="limit > 0"):
        moe_experts(x, idx, w, gu, dn, "clamped_swiglu", transposed=True, alpha=1.7, limit=0.0)
    with pytest.raises(ValueError, match="belong to activation='clamped_swiglu'"):
        moe_experts(x, idx, w, gu, dn, "silu", transposed=True, alpha=1.7)
    with pytest.raises(ValueError, match=r"gate_up_bias must be a floating-point tensor \[3, 10\]"):
        moe_experts(x, idx, w, gu, dn, transposed=True, gate_up_bias=bd)
    with pytest.raises(ValueError, match=r"down_proj \[E, I, H=16\]"):
        moe_experts(x, idx, w, gu, dn.transpose(1, 2), transposed=True)
    with pytest.raises(ValueError, match="share a dtype"):
        moe_experts(x, idx, w, gu, dn, transposed=True, down_bias=bd.double())


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_clamped_swiglu_torch_compile_fullgraph(backend):
    """Compiled (fullgraph, aot_eager): the gate kernel and its backward as custom ops, the biased GEMM loop."""
    import foak

    gu, dn, bg, bd = gpt_oss_params(3, 40, 24)
    x, w = torch.randn(11, 40), torch.rand(11, 2)
    idx = torch.stack([torch.tensor([0, 2])] * 11)  # expert 1 gets no token

    def fn(*a):
        return moe_experts(a[0], idx, a[1], a[2], a[3], "clamped_swiglu", gate_up_bias=a[4], down_bias=a[5],
                           interleaved=True, transposed=True, alpha=ALPHA, limit=0.6)

    foak.set_backend(backend)
    try:
        torch._dynamo.reset()
        ours = grads_of(torch.compile(fn, fullgraph=True, backend="aot_eager"), (x, w, gu, dn, bg, bd))
    finally:
        foak.set_backend("auto")
    exact = grads_of(lambda *a: gpt_oss_formula(a[0], idx, a[1], a[2], a[3], a[4], a[5], ALPHA, 0.6),
                     [t.double() for t in (x, w, gu, dn, bg, bd)])
    for name, a, b in zip(GPT_NAMES, ours, exact):
        assert rel(a, b) <= 1e-5, (name, rel(a, b))
    assert torch.count_nonzero(ours[5][1]) == 0 and torch.count_nonzero(ours[6][1]) == 0


def test_clamped_swiglu_under_autocast_over_fp32_weights_and_biases():
    gu, dn, bg, bd = gpt_oss_params(3, 40, 24)
    x, w = torch.randn(11, 40), torch.rand(11, 2)
    idx = torch.stack([torch.randperm(3)[:2] for _ in range(11)])

    def fn(*a):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return moe_experts(a[0], idx, a[1], a[2], a[3], "clamped_swiglu", gate_up_bias=a[4], down_bias=a[5],
                               interleaved=True, transposed=True, alpha=ALPHA, limit=0.6)

    ours = grads_of(fn, (x, w, gu, dn, bg, bd))
    exact = grads_of(lambda *a: gpt_oss_formula(a[0], idx, a[1], a[2], a[3], a[4], a[5], ALPHA, 0.6),
                     [t.double() for t in (x, w, gu, dn, bg, bd)])
    for name, a, b in zip(GPT_NAMES, ours, exact):
        assert a.dtype == torch.float32, name  # the output in hidden's dtype, the gradients in the parameters'
        # bf16 GEMMs: a value of h rounded across +-limit flips its clamp (max-norm error up to ~4e-2 here)
        assert rel(a, b) <= 6e-2, (name, rel(a, b))


def test_clamped_swiglu_recompute_h_same_gradients():
    gu, dn, bg, bd = gpt_oss_params(3, 40, 24)
    x, w = torch.randn(11, 40), torch.rand(11, 2)
    idx = torch.stack([torch.tensor([2, 0])] * 11)  # expert 1 gets no token

    def fn(recompute):
        return lambda *a: moe_experts(a[0], idx, a[1], a[2], a[3], "clamped_swiglu", recompute, gate_up_bias=a[4],
                                      down_bias=a[5], interleaved=True, transposed=True, alpha=ALPHA, limit=0.6)

    kept = grads_of(fn(False), (x, w, gu, dn, bg, bd))
    again = grads_of(fn(True), (x, w, gu, dn, bg, bd))
    for name, a, b in zip(GPT_NAMES, again, kept):
        assert torch.equal(a, b), name
    assert torch.count_nonzero(kept[5][1]) == 0 and torch.count_nonzero(kept[6][1]) == 0
    assert torch.count_nonzero(kept[5][0]) == 48 and torch.count_nonzero(kept[6][2]) == 40
