import math

import pytest
import torch
import torch.nn.functional as F
from test_cross_entropy import (OPTION_CASES, OPTIONS, TOL, bf16_exact_randn, make_target, on_kernel,
                                torch_cross_entropy)
from transformers.loss.loss_utils import ForCausalLMLoss

import foak.ops.linear_cross_entropy as lce_module
from foak.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from foak.testing import relative_error

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(37, 33, 129, False), (13, 65, 1000, True), (13, 33, 5003, True)]  # (N, H, V, bias)
REDUCTIONS = ["mean", "sum", "none"]


def make_inputs(n, h, vocab, dtype=torch.float32, bias=True, lead=None):
    """hidden [n, h] (or [*lead, h]), weight [V, h] scaled so the logits are ~ N(0, 4), bias [V] or None."""
    hidden = torch.randn(*(lead or (n,)), h).to(dtype)
    weight = (torch.randn(vocab, h) * (2 / math.sqrt(h))).to(dtype)
    b = (torch.randn(vocab) * 0.5).to(dtype) if bias else None
    return hidden, weight, b


def torch_linear_cross_entropy(hidden, weight, target, bias=None, shift=False, **opts):
    """Materialised fp32 logits through transformers' ForCausalLMLoss (shift=True, options it knows) or torch."""
    logits = hidden.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    ignore_index = opts.get("ignore_index", -100)
    hf_options = {"ignore_index", "num_items_in_batch", "reduction"}
    if shift and set(opts) <= hf_options and opts.get("reduction", "mean") == "mean":
        return ForCausalLMLoss(logits, target, vocab_size=weight.shape[0], **{k: v for k, v in opts.items()
                                                                              if k != "reduction"})
    if shift:
        target = F.pad(target[..., 1:], (0, 1), value=ignore_index)
    return torch_cross_entropy(logits, target, **opts)


def _loss_and_grads(fn, hidden, weight, target, bias, upstream, **opts):
    """fn on fresh leaf copies: (loss, z_loss or None, {name: gradient})."""
    leaves = {"hidden": hidden, "weight": weight, "bias": bias}
    leaves = {k: v.detach().clone().requires_grad_() for k, v in leaves.items() if v is not None}
    out = fn(leaves["hidden"], leaves["weight"], target, leaves.get("bias"), **opts)
    loss, z_loss = out if opts.get("return_z_loss") else (out, None)
    grads = torch.autograd.grad(loss, list(leaves.values()), upstream.reshape(loss.shape).to(loss.dtype))
    return loss.detach(), z_loss, dict(zip(leaves, grads))


def check_linear_cross_entropy(hidden, weight, target, bias=None, dtype=torch.float32, upstream=None, **opts):
    """linear_cross_entropy in ``dtype`` vs the reference and vs torch/HF on the same values in fp32:
    loss, z_loss (when returned) and the gradients of hidden, weight and bias."""
    tol = TOL[dtype]
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    bias = bias.to(dtype) if bias is not None else None
    if upstream is None:
        upstream = bf16_exact_randn(target.numel()) if opts.get("reduction") == "none" else torch.tensor(1.0)
    upstream = torch.as_tensor(upstream, dtype=torch.float32)
    loss, z_loss, grads = _loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, upstream, **opts)
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is not None:
            assert grads[name].shape == t.shape and grads[name].dtype == t.dtype, name
    if opts.get("reduction", "mean") == "none":
        assert loss.numel() == target.numel()
    else:
        assert loss.dim() == 0
    if opts.get("return_z_loss"):
        assert not z_loss.requires_grad
    up32 = lambda t: t.float() if t is not None else None
    errors = {}
    for ref_name, expected_fn in (("reference", linear_cross_entropy_reference),
                                  ("torch", torch_linear_cross_entropy)):
        ref_loss, ref_z, ref_grads = _loss_and_grads(expected_fn, up32(hidden), up32(weight), target, up32(bias),
                                                     upstream, **opts)
        errors[f"loss vs {ref_name}"] = relative_error(loss.reshape(-1), ref_loss.reshape(-1))
        if opts.get("return_z_loss"):
            errors[f"z_loss vs {ref_name}"] = relative_error(z_loss.reshape(-1), ref_z.reshape(-1))
        for k in grads:
            errors[f"grad_{k} vs {ref_name}"] = relative_error(grads[k], ref_grads[k])
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"errors over {tol}: {bad} (all: {errors})"
    return loss, z_loss, grads


# ---- numerics -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-H{s[1]}-V{s[2]}{'-bias' if s[3] else ''}")
def test_matches_reference_and_torch(shape, reduction, dtype):
    n, h, vocab, bias = shape
    hidden, weight, b = make_inputs(n, h, vocab, dtype, bias)
    target = make_target(n, vocab)
    check_linear_cross_entropy(hidden, weight, target, b, dtype, reduction=reduction)


@pytest.mark.parametrize("name, reduction, dtype", OPTION_CASES)
def test_options_alone_and_combined(name, reduction, dtype, request):
    if not on_kernel(name, reduction):  # the reference against torch (test_cross_entropy.py: which cases)
        request.getfixturevalue("reference_ops")
    opts = OPTIONS[name]
    hidden, weight, b = make_inputs(13, 65, 1000, dtype)
    target = make_target(13, 1000, opts.get("ignore_index", -100))
    if opts.get("ignore_index") == 7:
        target[4] = 7
    _, z_loss, _ = check_linear_cross_entropy(hidden, weight, target, b, dtype, reduction=reduction, **opts)
    if opts.get("lse_square_scale"):
        assert (z_loss != 0).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", ["plain", "all+num_items"])  # sum: all options but num_items_in_batch
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_upstream_gradient_not_one(reduction, options, dtype):
    opts = {} if options == "plain" else dict(OPTIONS[options])
    if reduction == "sum":
        opts.pop("num_items_in_batch", None)
    hidden, weight, b = make_inputs(37, 33, 129, dtype)
    target = make_target(37, 129, opts.get("ignore_index", -100))
    check_linear_cross_entropy(hidden, weight, target, b, dtype, upstream=3.5, reduction=reduction, **opts)


def test_loss_times_constant_backward():
    hidden, weight, b = make_inputs(13, 33, 1000)
    target = make_target(13, 1000)
    for reduction in ("mean", "sum"):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
        (linear_cross_entropy(*leaves[:2], target, leaves[2], reduction=reduction) * 3.5).backward()
        refs = [t.clone().requires_grad_() for t in (hidden, weight, b)]
        (linear_cross_entropy_reference(*refs[:2], target, refs[2], reduction=reduction) * 3.5).backward()
        for t, r in zip(leaves, refs):
            assert relative_error(t.grad, r.grad) <= 1e-5


def test_reduction_none_retained_graph_and_loud_second_mean_backward():
    hidden, weight, _ = make_inputs(13, 33, 1000, bias=False)
    target = make_target(13, 1000)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, target, reduction="none")
    u = bf16_exact_randn(13)
    g1 = torch.autograd.grad(loss, (h, w), u, retain_graph=True)
    g2 = torch.autograd.grad(loss, (h, w), u * 3.5)
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    gr = torch.autograd.grad(linear_cross_entropy_reference(hr, wr, target, reduction="none"), (hr, wr), u)
    for a, b, r in zip(g1, g2, gr):
        assert relative_error(a, r) <= 1e-5 and relative_error(b, r * 3.5) <= 1e-5
    loss = linear_cross_entropy(h, w, target)
    torch.autograd.grad(loss, (h, w), retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        torch.autograd.grad(loss, (h, w))


def test_only_some_inputs_need_gradients():
    # a frozen LM head (only hidden trains) and frozen hidden states (only the head trains)
    hidden, weight, b = make_inputs(13, 33, 1000)
    target = make_target(13, 1000)
    ref = {k: v.clone().requires_grad_() for k, v in (("h", hidden), ("w", weight), ("b", b))}
    ref_loss = linear_cross_entropy_reference(ref["h"], ref["w"], target, ref["b"])
    ref_grads = dict(zip(ref, torch.autograd.grad(ref_loss, list(ref.values()))))
    for trainable in (("h",), ("w", "b"), ("w",), ("b",)):
        leaves = {k: v.clone().requires_grad_(k in trainable) for k, v in (("h", hidden), ("w", weight), ("b", b))}
        loss = linear_cross_entropy(leaves["h"], leaves["w"], target, leaves["b"])
        grads = torch.autograd.grad(loss, [leaves[k] for k in trainable])
        assert relative_error(loss, ref_loss) <= 1e-5
        for k, g in zip(trainable, grads):
            assert relative_error(g, ref_grads[k]) <= 1e-5, (trainable, k)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden.clone().requires_grad_(), weight, target, b)
    assert relative_error(loss, ref_loss) <= 1e-5


def test_ignored_rows_get_exactly_zero_hidden_gradient():
    hidden, weight, b = make_inputs(13, 33, 1000)
    target = make_target(13, 1000)
    h = hidden.clone().requires_grad_()
    linear_cross_entropy(h, weight, target, b, label_smoothing=0.1, lse_square_scale=1e-2).backward()
    ignored = target == -100
    assert not h.grad[ignored].any() and h.grad[~ignored].abs().sum(-1).min() > 0


# ---- shift and transformers' ForCausalLMLoss ------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_items", [None, 17, "tensor"])
@pytest.mark.parametrize("ignore_index", [-100, -1])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_shift_matches_hf_for_causal_lm_loss(bias, ignore_index, num_items, dtype, request):
    if dtype == torch.bfloat16 and not (bias and num_items == "tensor"):
        # the shift, bias, ignore_index and num_items handling runs on every fp32 case through the kernels;
        # bf16 through the kernels once (HF Trainer's tensor count, bias), else foak's reference against HF
        request.getfixturevalue("reference_ops")
    b_, s, h_, vocab = 3, 7, 33, 1000
    hidden, weight, b = make_inputs(None, h_, vocab, dtype, bias, lead=(b_, s))
    labels = torch.randint(0, vocab, (b_, s))
    labels[0, :3] = ignore_index  # a prompt
    labels[2, 5] = ignore_index
    if num_items == "tensor":
        num_items = (labels[:, 1:] != ignore_index).sum()  # what the HF Trainer passes
    opts = {"ignore_index": ignore_index, "num_items_in_batch": num_items}
    loss, _, grads = _loss_and_grads(linear_cross_entropy, hidden, weight, labels, b, torch.tensor(1.0), shift=True,
                                     **opts)
    up32 = lambda t: t.float() if t is not None else None
    hf_loss, _, hf_grads = _loss_and_grads(torch_linear_cross_entropy, up32(hidden), up32(weight), labels, up32(b),
                                           torch.tensor(1.0), shift=True, **opts)
    tol = TOL[dtype]
    assert relative_error(loss, hf_loss) <= tol
    for k in grads:
        assert relative_error(grads[k], hf_grads[k]) <= tol, k
    assert not grads["hidden"][:, -1].any()  # the last position predicts nothing


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_shift_equals_manual_shift(reduction):
    hidden, weight, b = make_inputs(None, 33, 1000, lead=(3, 7))
    labels = torch.randint(0, 1000, (3, 7))
    labels[1, :4] = -100
    u = bf16_exact_randn(3, 7) if reduction == "none" else torch.tensor(1.0)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss1 = linear_cross_entropy(h1, w1, labels, b, shift=True, reduction=reduction)
    loss1.backward(u.reshape(loss1.shape))
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss2 = linear_cross_entropy(h2[:, :-1], w2, labels[:, 1:], b, reduction=reduction)  # non-contiguous hidden
    loss2.backward(u[:, :-1].reshape(loss2.shape) if reduction == "none" else u)
    if reduction == "none":
        assert loss1.numel() == 21 and loss2.numel() == 18
        loss1 = loss1.reshape(3, 7)
        assert not loss1[:, -1].any()
        loss1, loss2 = loss1[:, :-1], loss2.reshape(3, 6)
    assert relative_error(loss1, loss2) <= 1e-5
    assert relative_error(h1.grad, h2.grad) <= 1e-5 and relative_error(w1.grad, w2.grad) <= 1e-5


# ---- all rows ignored, gradient accumulation, chunking ------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", ["plain", "all", "all+num_items"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_rows_ignored(reduction, options, dtype):
    opts = {} if options == "plain" else dict(OPTIONS[options])
    if reduction != "mean":
        opts.pop("num_items_in_batch", None)
    hidden, weight, b = make_inputs(13, 33, 1000, dtype)
    target = torch.full((13,), opts.get("ignore_index", -100))
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    out = linear_cross_entropy(leaves[0], leaves[1], target, leaves[2], reduction=reduction, **opts)
    loss, z_loss = out if opts.get("return_z_loss") else (out, None)
    grads = torch.autograd.grad(loss, leaves, torch.full(loss.shape, 2.0, dtype=loss.dtype), allow_unused=True)
    assert torch.isfinite(loss).all() and not loss.any()
    for g, t in zip(grads, leaves):  # zero gradients (None, autograd's zero, is fine too)
        assert g is None or (g.shape == t.shape and torch.isfinite(g).all() and not g.any())
    if z_loss is not None:
        assert torch.isfinite(z_loss).all() and not z_loss.any()


def test_shift_of_length_one_sequences_ignores_everything():
    hidden, weight, _ = make_inputs(None, 33, 129, lead=(4, 1))
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, torch.randint(0, 129, (4, 1)), shift=True)
    loss.backward()
    assert loss.item() == 0 and not h.grad.any()


@pytest.mark.parametrize("layout", ["flat", "shift"])
@pytest.mark.parametrize("num_items_type", ["int", "tensor"])
def test_gradient_accumulation_equals_one_big_batch(num_items_type, layout):
    micro, vocab, h_ = 4, 1000, 33
    lead = (micro * 9,) if layout == "flat" else (micro * 2, 5)  # 4 micro-batches of 9 rows / 2 sequences
    hidden, weight, b = make_inputs(None, h_, vocab, lead=lead)
    labels = torch.randint(0, vocab, lead)
    labels[torch.rand(lead) < 0.3] = -100  # micro-batches with different numbers of valid rows
    labels[9:13] = -100
    per = lead[0] // micro
    if layout == "flat":
        total = (labels != -100).sum()
    else:
        total = (labels[:, 1:] != -100).sum()
    num_items = int(total) if num_items_type == "int" else total
    shift = layout == "shift"
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    summed = torch.zeros(())
    for i in range(micro):
        rows = slice(i * per, (i + 1) * per)
        loss = linear_cross_entropy(leaves[0][rows], leaves[1], labels[rows], leaves[2], shift=shift,
                                    num_items_in_batch=num_items)
        loss.backward()
        summed += loss.detach()
    big_leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    big = linear_cross_entropy(big_leaves[0], big_leaves[1], labels, big_leaves[2], shift=shift)
    big.backward()
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    ref = torch_linear_cross_entropy(ref_leaves[0], ref_leaves[1], labels, ref_leaves[2], shift=shift)
    ref.backward()
    assert relative_error(summed, big) <= 1e-5 and relative_error(big, ref) <= 1e-5
    for name, a, bb, r in zip(("hidden", "weight", "bias"), leaves, big_leaves, ref_leaves):
        assert relative_error(a.grad, bb.grad) <= 1e-5, name
        assert relative_error(bb.grad, r.grad) <= 1e-5, name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_more_rows_than_one_chunk(reduction, dtype, monkeypatch):
    monkeypatch.setitem(lce_module.TUNING, "chunk_rows", 8)
    hidden, weight, b = make_inputs(37, 33, 1000, dtype)
    target = make_target(37, 1000, ignored=(2, None, 5))
    target[10:20] = -100  # a whole chunk's worth of ignored rows
    opts = {"label_smoothing": 0.1, "lse_square_scale": 1e-2, "return_z_loss": True}
    if reduction == "mean":
        opts["num_items_in_batch"] = torch.tensor(40)
    check_linear_cross_entropy(hidden, weight, target, b, dtype, reduction=reduction, **opts)
    check_linear_cross_entropy(hidden, weight, target, b, dtype, reduction=reduction, upstream=(
        None if reduction == "none" else 3.5))


def test_chunk_bytes_sets_the_chunk_and_not_the_result(monkeypatch):
    hidden, weight, b = make_inputs(37, 33, 1000, torch.float32)
    target = make_target(37, 1000, ignored=(2, None, 5))
    seen = []
    real = lce_module.ce_launch
    monkeypatch.setattr(lce_module, "ce_launch", lambda logits, *a, **k: (seen.append(logits.shape[0]), real(logits, *a, **k))[1])

    def run(**kw):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
        loss = linear_cross_entropy(*leaves[:2], target, leaves[2], **kw)
        loss.backward()
        return [loss] + [t.grad for t in leaves]

    n_valid = int((target != -100).sum())
    assert 16 < n_valid < 32
    default = run()
    assert seen == [n_valid]  # one chunk under the default budget
    seen.clear()
    small = run(chunk_bytes=16 * 1000 * 4)  # 16 fp32 rows of 1000 logits
    assert seen == [16, n_valid - 16]
    for a, bb in zip(default, small):
        assert relative_error(a, bb) <= 1e-6
    for bad in (0, -5, 1.5, "1MiB"):
        with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
            linear_cross_entropy(hidden, weight, target, chunk_bytes=bad)


# ---- tied weights, layouts ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_tied_embedding_gradients_add_up(reduction, dtype):
    vocab, h_, n = 1000, 33, 13
    emb = torch.nn.Embedding(vocab, h_).to(dtype)
    mix = (torch.randn(h_, h_) / math.sqrt(h_)).to(dtype)
    ids = torch.randint(0, vocab, (n,))
    ids[3] = ids[5]  # a repeated token: its embedding row gets two contributions
    target = make_target(n, vocab)
    u = bf16_exact_randn(n) if reduction == "none" else torch.tensor(2.0)

    def run(fn, weight, m):
        hidden = torch.tanh(F.embedding(ids, weight) @ m)  # the embedding lookup uses the head's weight
        loss = fn(hidden, weight, target, reduction=reduction)
        return torch.autograd.grad(loss, (weight, m), u.reshape(loss.shape).to(loss.dtype))

    w = emb.weight.detach().clone().requires_grad_()
    m = mix.clone().requires_grad_()
    gw, gm = run(linear_cross_entropy, w, m)
    wr = emb.weight.detach().float().clone().requires_grad_()
    mr = mix.float().clone().requires_grad_()
    gwr, gmr = run(linear_cross_entropy_reference, wr, mr)
    tol = TOL[dtype]
    assert relative_error(gw, gwr) <= tol and relative_error(gm, gmr) <= tol
    # both contributions are there: the embedding rows of the input ids differ from the head-only gradient
    hidden = torch.tanh(F.embedding(ids, wr.detach()) @ mr.detach())
    head_loss = linear_cross_entropy_reference(hidden, wr, target, reduction=reduction)
    (head_only,) = torch.autograd.grad(head_loss, wr, u.reshape(head_loss.shape))
    assert relative_error(gwr[ids], head_only[ids]) > 0.01


def test_tied_embedding_module_and_parameter_grad():
    # the usual layout: the lm_head weight is the nn.Embedding's parameter, gradients land in .grad
    vocab, h_, n = 1000, 33, 13
    ids, target = torch.randint(0, vocab, (n,)), make_target(n, vocab)
    grads = []
    for fn in (linear_cross_entropy, linear_cross_entropy_reference):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(vocab, h_)
        hidden = emb(ids) * 2.0 + 1.0
        fn(hidden, emb.weight, target, label_smoothing=0.1).backward()
        grads.append(emb.weight.grad)
    assert relative_error(grads[0], grads[1]) <= 1e-5


@pytest.mark.parametrize("layout", ["column_slice", "transposed", "sequence_slice"])
def test_non_contiguous_hidden(layout):
    n, h_, vocab = 13, 33, 1000
    _, weight, b = make_inputs(n, h_, vocab)
    if layout == "column_slice":
        base = torch.randn(n, h_ + 7)
        take = lambda t: t[:, 3:3 + h_]
    elif layout == "transposed":
        base = torch.randn(h_, n)
        take = lambda t: t.t()
    else:
        base = torch.randn(2, 8, h_)  # hidden_states[:, 1:] of [B, S + 1, H]
        take = lambda t: t[:, 1:]
    lead = take(base).shape[:-1]
    target = make_target(lead.numel(), vocab).reshape(lead)
    for reduction in REDUCTIONS:
        x = base.clone().requires_grad_()
        hidden = take(x)
        assert not hidden.is_contiguous()
        loss = linear_cross_entropy(hidden, weight, target, b, reduction=reduction)
        u = torch.ones(loss.shape) if reduction != "none" else bf16_exact_randn(*loss.shape)
        (g,) = torch.autograd.grad(loss, x, u)
        xr = base.clone().requires_grad_()
        ref = linear_cross_entropy_reference(take(xr), weight, target, b, reduction=reduction)
        (gr,) = torch.autograd.grad(ref, xr, u.reshape(ref.shape))
        assert relative_error(loss.reshape(-1), ref.reshape(-1)) <= 1e-5 and relative_error(g, gr) <= 1e-5


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"weight": torch.randn(16, 9)}, r"shape|\[V, H\]"),
        ({"weight": torch.randn(16)}, r"shape|\[V, H\]"),
        ({"target": torch.zeros(4, dtype=torch.long)}, "shape"),
        ({"bias": torch.randn(17)}, "shape"),
        ({"bias": torch.randn(16, 1)}, "shape"),
        ({"hidden": torch.randint(0, 5, (5, 8))}, "dtype"),
        ({"weight": torch.randint(0, 5, (16, 8))}, "dtype"),
        ({"target": torch.zeros(5)}, "dtype|int64"),
        ({"hidden": torch.randn(5, 8, dtype=torch.bfloat16)}, "dtype"),
        ({"weight": torch.randn(16, 8, device="meta")}, "device"),
        ({"bias": torch.randn(16, device="meta")}, "device"),
        ({"target": torch.tensor([0, 1, 16, 2, 3])}, "out of range"),
        ({"target": torch.tensor([0, 1, -5, 2, 3])}, "out of range"),
        ({"target": torch.tensor([0, 1, -100, 2, 3]), "ignore_index": -1}, "out of range"),
        ({"hidden": torch.randn(0, 8), "target": torch.zeros(0, dtype=torch.long)}, "empty"),
        ({"reduction": "avg"}, "reduction"),
        ({"reduction": "sum", "num_items_in_batch": 4}, "num_items_in_batch"),
        ({"reduction": "none", "num_items_in_batch": torch.tensor(4)}, "num_items_in_batch"),
        ({"softcap": 0.0}, "softcap"),
        ({"logits_scaling": 0.0}, "logits_scaling"),
        ({"label_smoothing": 1.0}, "label_smoothing"),
        ({"label_smoothing": -0.1}, "label_smoothing"),
        ({"shift": True}, r"shift|\[B, S"),  # shift needs hidden [B, S, H]
    ],
)
def test_bad_input(kwargs, message):
    args = {"hidden": torch.randn(5, 8), "weight": torch.randn(16, 8), "target": torch.tensor([0, 1, 15, -100, 3]),
            "bias": None}
    args.update(kwargs)
    hidden, weight, target, bias = (args.pop(k) for k in ("hidden", "weight", "target", "bias"))
    with pytest.raises(ValueError, match=f"(?i){message}"):
        linear_cross_entropy(hidden, weight, target, bias, **args)


def test_rows_per_chunk_fill_whole_gemm_tiles_within_the_budget():
    from foak.ops.linear_cross_entropy import _rows_per_chunk

    cases = [(128256, 2, 512 << 20), (151936, 2, 512 << 20), (128256, 4, 1 << 30), (262144, 2, 512 << 20)]
    for vocab, size, budget in cases:
        rows = _rows_per_chunk(vocab, size, budget)
        assert rows % 128 == 0 and rows * vocab * size <= budget < (rows + 128) * vocab * size, (vocab, rows)
    small = _rows_per_chunk(128256, 2, 112 << 20)  # under 1024 rows: multiples of 16 (448 rows, not 384)
    assert small == 448
