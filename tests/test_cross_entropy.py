import pytest
import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss, fixed_cross_entropy

import foak.ops.cross_entropy as ce_module
from foak.ops.cross_entropy import cross_entropy, cross_entropy_reference
from foak.testing import relative_error

# bf16: the op on bf16 logits vs an fp32 reference on the same bf16-rounded values upcast
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(37, 129), (13, 1000), (13, 5003)]  # 5003: more than one 4096-wide block of the vocabulary (below)
REDUCTIONS = ["mean", "sum", "none"]

# Every option alone, a few pairs, and all at once. ``num_items_in_batch`` goes with "mean" only.
OPTIONS = {
    "ignore_index=-1": {"ignore_index": -1},
    "ignore_index=7": {"ignore_index": 7},  # a real class id: rows whose target is 7 are ignored
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"lse_square_scale": 1e-2, "return_z_loss": True},
    "softcap": {"softcap": 5.0},  # logits ~ 3 * randn, so tanh saturates some of them
    "logits_scaling": {"logits_scaling": 2.5},
    "num_items_int": {"num_items_in_batch": 29},
    "num_items_tensor": {"num_items_in_batch": torch.tensor(29)},
    "return_z_loss_without_z_loss": {"return_z_loss": True},
    "smoothing+z_loss": {"label_smoothing": 0.2, "lse_square_scale": 3e-2, "return_z_loss": True},
    "softcap+scaling": {"softcap": 4.0, "logits_scaling": 0.7},
    "ignore_index=-1+num_items": {"ignore_index": -1, "num_items_in_batch": torch.tensor(11)},
    "all": {"ignore_index": 7, "label_smoothing": 0.1, "lse_square_scale": 1e-2, "return_z_loss": True,
            "softcap": 5.0, "logits_scaling": 2.5},
    "all+num_items": {"ignore_index": -1, "label_smoothing": 0.1, "lse_square_scale": 1e-2, "return_z_loss": True,
                      "softcap": 5.0, "logits_scaling": 2.5, "num_items_in_batch": torch.tensor(23)},
}
# fp32 for every option set; bf16 (slower, looser) for the ones that change the kernel's arithmetic most
BF16_OPTIONS = ("z_loss", "softcap", "all", "all+num_items")


def on_kernel(name, reduction):
    """Which option cases run the kernels (Triton interpreter): every option set with "mean" (the kernel's
    forward-computed gradient; "sum" differs only in the host's scale), and the "all" sets with every
    reduction ("none": the separate backward pass, every option flag on). The other (option, reduction)
    pairs run foak's reference (reference backend), checked against torch/transformers as the kernels are."""
    return reduction == "mean" or name.startswith("all")


OPTION_CASES = [
    pytest.param(name, reduction, dtype, id=f"{name}-{reduction}-{str(dtype)[6:]}"
                 + ("" if on_kernel(name, reduction) else "-reference"))
    for name, opts in OPTIONS.items()
    for reduction in REDUCTIONS
    for dtype in DTYPES
    if (reduction == "mean" or "num_items_in_batch" not in opts) and (dtype == torch.float32 or name in BF16_OPTIONS)
]


# ---- helpers (also used by test_linear_cross_entropy.py) ------------------------------------------
def make_target(n, vocab, ignore_index=-100, ignored=(2, None, 3)):
    """Random class ids with both ends of the vocabulary present and rows ``ignored`` (a slice) ignored."""
    target = torch.randint(0, vocab, (n,))
    target[0], target[1 % n] = vocab - 1, 0
    target[slice(*ignored)] = ignore_index
    return target


def torch_cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                        lse_square_scale=0.0, softcap=None, logits_scaling=1.0, num_items_in_batch=None,
                        return_z_loss=False):
    """The documented loss assembled from torch's and transformers' own functions, in fp32."""
    z = logits.float().reshape(-1, logits.shape[-1])
    if logits_scaling != 1.0:
        z = z / logits_scaling
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    target = target.long().reshape(-1)
    valid = target != ignore_index
    z_rows = torch.where(valid, lse_square_scale * torch.logsumexp(z, -1).square(), 0.0)

    def ce(red):
        return F.cross_entropy(z, target, ignore_index=ignore_index, reduction=red, label_smoothing=label_smoothing)

    if reduction == "none":
        loss, z_loss = ce("none") + z_rows, z_rows
    elif reduction == "sum":
        loss, z_loss = ce("sum") + z_rows.sum(), z_rows.sum()
    elif num_items_in_batch is not None:
        if label_smoothing:  # fixed_cross_entropy has no label smoothing
            loss = ce("sum") / num_items_in_batch
        else:
            loss = fixed_cross_entropy(z, target, num_items_in_batch, ignore_index)
        z_loss = z_rows.sum() / num_items_in_batch
        loss = loss + z_loss
    else:
        z_loss = z_rows.sum() / valid.sum()
        loss = ce("mean") + z_loss
    return (loss, z_loss.detach()) if return_z_loss else loss


def bf16_exact_randn(*shape):
    """randn values that bf16 represents exactly (so an upstream gradient is the same in every dtype)."""
    return torch.randn(*shape).to(torch.bfloat16).float()


def _loss_and_grad(fn, logits, target, upstream, **opts):
    """fn on a fresh leaf copy of ``logits``: (loss, z_loss or None, d loss/d logits for ``upstream``, leaf)."""
    x = logits.detach().clone().requires_grad_()
    out = fn(x, target, **opts)
    loss, z_loss = out if opts.get("return_z_loss") else (out, None)
    (grad,) = torch.autograd.grad(loss, x, upstream.reshape(loss.shape).to(loss.dtype))
    return loss.detach(), z_loss, grad, x


def check_cross_entropy(logits, target, dtype=torch.float32, upstream=None, **opts):
    """cross_entropy on ``logits`` in ``dtype`` vs the reference and vs torch on the same values in fp32.

    ``upstream``: the incoming gradient (scalar for mean/sum; None = 1.0 / random per row for "none").
    Checks loss, z_loss (when returned), the logits' gradient, and that the logits were not modified.
    """
    tol = TOL[dtype]
    logits = logits.to(dtype)
    if upstream is None:
        upstream = bf16_exact_randn(target.numel()) if opts.get("reduction") == "none" else torch.tensor(1.0)
    upstream = torch.as_tensor(upstream, dtype=torch.float32)
    loss, z_loss, grad, x = _loss_and_grad(cross_entropy, logits, target, upstream, **opts)
    assert torch.equal(x.detach(), logits), "logits were modified (inplace_backward=False)"
    assert grad.shape == logits.shape
    if opts.get("reduction", "mean") == "none":
        assert loss.numel() == target.numel()
    else:
        assert loss.dim() == 0
    if opts.get("return_z_loss"):
        assert not z_loss.requires_grad and z_loss.shape == loss.shape
    errors = {}
    for name, expected_fn in (("reference", cross_entropy_reference), ("torch", torch_cross_entropy)):
        ref_loss, ref_z, ref_grad, _ = _loss_and_grad(expected_fn, logits.float(), target, upstream, **opts)
        errors[f"loss vs {name}"] = relative_error(loss.reshape(-1), ref_loss.reshape(-1))
        errors[f"grad vs {name}"] = relative_error(grad, ref_grad)
        if opts.get("return_z_loss"):
            errors[f"z_loss vs {name}"] = relative_error(z_loss.reshape(-1), ref_z.reshape(-1))
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"errors over {tol}: {bad} (all: {errors})"
    return loss, z_loss, grad


def _inputs(n, vocab, dtype=torch.float32, ignore_index=-100, scale=3.0):
    return (torch.randn(n, vocab) * scale).to(dtype), make_target(n, vocab, ignore_index)


# ---- numerics -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_and_torch(shape, reduction, dtype, monkeypatch):
    monkeypatch.setitem(ce_module.TUNING, "block", 4096)  # (the default block holds a 5003-wide row whole)
    logits, target = _inputs(*shape, dtype)
    check_cross_entropy(logits, target, dtype, reduction=reduction)


@pytest.mark.parametrize("name, reduction, dtype", OPTION_CASES)
def test_options_alone_and_combined(name, reduction, dtype, request):
    if not on_kernel(name, reduction):
        request.getfixturevalue("reference_ops")
    opts = OPTIONS[name]
    logits, target = _inputs(13, 1000, dtype, opts.get("ignore_index", -100))
    if opts.get("ignore_index") == 7:
        target[4] = 7  # also a "random" row whose class id happens to be the ignore_index
    _, z_loss, _ = check_cross_entropy(logits, target, dtype, reduction=reduction, **opts)
    if opts.get("lse_square_scale"):
        assert (z_loss != 0).any()
    elif opts.get("return_z_loss"):
        assert not z_loss.any()


def test_options_change_the_loss():
    # guards the option tests above: each option must actually move the number
    logits, target = _inputs(13, 1000)
    base = cross_entropy(logits, target)
    for opts in ({"label_smoothing": 0.1}, {"lse_square_scale": 1e-2}, {"softcap": 5.0}, {"logits_scaling": 2.5},
                 {"num_items_in_batch": 29}):
        assert abs(cross_entropy(logits, target, **opts) - base) > 1e-3, opts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", ["plain", "all+num_items"])  # sum: all options but num_items_in_batch
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_upstream_gradient_not_one(reduction, options, dtype):
    opts = {} if options == "plain" else OPTIONS[options]
    if reduction == "sum":
        opts = {k: v for k, v in opts.items() if k != "num_items_in_batch"}
    logits, target = _inputs(37, 129, dtype, opts.get("ignore_index", -100))
    check_cross_entropy(logits, target, dtype, upstream=3.5 if dtype == torch.float32 else -0.25,
                        reduction=reduction, **opts)


def test_loss_times_constant_backward():
    logits, target = _inputs(13, 1000)
    for reduction in ("mean", "sum"):
        x = logits.clone().requires_grad_()
        (cross_entropy(x, target, reduction=reduction) * 3.5).backward()
        xr = logits.clone().requires_grad_()
        (cross_entropy_reference(xr, target, reduction=reduction) * 3.5).backward()
        assert relative_error(x.grad, xr.grad) <= 1e-5


def test_second_backward_through_a_retained_graph():
    # "none" recomputes its gradient in the backward: a retained graph can be differentiated again
    logits, target = _inputs(13, 1000)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, reduction="none")
    u = bf16_exact_randn(13)
    (g1,) = torch.autograd.grad(loss, x, u, retain_graph=True)
    g1_copy = g1.clone()
    (g2,) = torch.autograd.grad(loss, x, u * 3.5)
    xr = logits.clone().requires_grad_()
    (gr,) = torch.autograd.grad(cross_entropy_reference(xr, target, reduction="none"), xr, u)
    assert torch.equal(g1, g1_copy)
    assert relative_error(g1, gr) <= 1e-5 and relative_error(g2, gr * 3.5) <= 1e-5


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_second_backward_of_mean_or_sum_is_loud(reduction):
    # mean/sum compute the gradient in the forward and hand it out once: a second backward must fail loudly
    logits, target = _inputs(13, 1000)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, reduction=reduction)
    (g1,) = torch.autograd.grad(loss * 2.0, x, retain_graph=True)
    g1_copy = g1.clone()
    with pytest.raises(RuntimeError, match="backward ran twice"):
        torch.autograd.grad(loss, x)
    assert torch.equal(g1, g1_copy)  # the gradient handed out first is not touched by the failed second call
    xr = logits.clone().requires_grad_()
    (gr,) = torch.autograd.grad(cross_entropy_reference(xr, target, reduction=reduction) * 2.0, xr)
    assert relative_error(g1, gr) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_leading_dimensions(reduction, dtype):
    # logits [B, S, V], target [B, S]
    logits = (torch.randn(2, 7, 1000) * 3).to(dtype)
    target = make_target(14, 1000).view(2, 7)
    check_cross_entropy(logits, target, dtype, reduction=reduction, label_smoothing=0.1)


@pytest.mark.parametrize("tuning", [{"block": 512}, {"block": 1024, "programs_per_sm": 1}], ids=["blocks", "blocks-persistent"])
def test_kernel_variants(tuning, monkeypatch):
    # the launch knobs the GPU sweep picks from: several vocabulary blocks per row (with a partial last
    # one) must give the same numbers, whatever the current defaults are
    for key, value in tuning.items():
        assert key in ce_module.TUNING, key
        monkeypatch.setitem(ce_module.TUNING, key, value)
    opts = {"label_smoothing": 0.1, "lse_square_scale": 1e-2, "return_z_loss": True, "softcap": 5.0}
    for n, vocab in ((13, 1000), (3, 5003)):
        logits, target = _inputs(n, vocab)
        check_cross_entropy(logits, target, reduction="none")
        for reduction in REDUCTIONS:
            check_cross_entropy(logits, target, reduction=reduction, **opts)
        check_cross_entropy(logits, target, torch.bfloat16, reduction="mean", **opts)


@pytest.mark.parametrize("vocab", [1, 2, 3])
def test_tiny_vocabulary(vocab):
    logits = torch.randn(7, vocab) * 3
    target = torch.randint(0, vocab, (7,))
    target[2] = -100
    for reduction in REDUCTIONS:
        check_cross_entropy(logits, target, reduction=reduction)
        check_cross_entropy(logits, target, reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-2)


def test_int32_target():
    logits, target = _inputs(37, 129)
    for reduction in REDUCTIONS:
        check_cross_entropy(logits, target.int(), reduction=reduction)


def test_non_contiguous_logits():
    base = torch.randn(13, 1100) * 3
    logits = base[:, 50:1050]
    assert not logits.is_contiguous()
    target = make_target(13, 1000)
    for reduction in REDUCTIONS:
        x = base.clone()[:, 50:1050].requires_grad_()  # a non-contiguous leaf
        loss = cross_entropy(x, target, reduction=reduction)
        u = torch.ones_like(loss) if reduction != "none" else bf16_exact_randn(13)
        (g,) = torch.autograd.grad(loss, x, u)
        xr = logits.clone().requires_grad_()
        ref = cross_entropy_reference(xr, target, reduction=reduction)
        (gr,) = torch.autograd.grad(ref, xr, u)
        assert relative_error(loss, ref) <= 1e-5 and relative_error(g, gr) <= 1e-5


def test_large_logits_are_stable():
    logits = torch.randn(13, 1000) * 300  # exp overflows without the max subtraction
    target = make_target(13, 1000)
    for reduction in REDUCTIONS:
        check_cross_entropy(logits, target, reduction=reduction, lse_square_scale=1e-4, return_z_loss=True)


def test_forward_without_grad():
    logits, target = _inputs(13, 1000)
    with torch.no_grad():
        loss = cross_entropy(logits.clone().requires_grad_(), target, reduction="mean")
    assert relative_error(loss, cross_entropy_reference(logits, target)) <= 1e-5
    for reduction in REDUCTIONS:  # logits that do not require grad
        loss = cross_entropy(logits, target, reduction=reduction)
        assert relative_error(loss, cross_entropy_reference(logits, target, reduction=reduction)) <= 1e-5


# ---- transformers' ForCausalLMLoss ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_items", [None, 17, "tensor"])
@pytest.mark.parametrize("ignore_index", [-100, -1])
def test_matches_hf_for_causal_lm_loss(ignore_index, num_items, dtype):
    b, s, vocab = 3, 7, 1000
    logits = (torch.randn(b, s, vocab) * 3).to(dtype)
    labels = torch.randint(0, vocab, (b, s))
    labels[0, :3] = ignore_index  # a prompt
    labels[2, 5] = ignore_index
    if num_items == "tensor":
        num_items = (labels[:, 1:] != ignore_index).sum()  # what the HF Trainer passes
    x_hf = logits.detach().float().clone().requires_grad_()  # HF upcasts too: an fp32 reference on the bf16-rounded values
    hf = ForCausalLMLoss(x_hf, labels, vocab_size=vocab, num_items_in_batch=num_items, ignore_index=ignore_index)
    hf.backward()
    shifted = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    x = logits.detach().clone().requires_grad_()
    loss = cross_entropy(x, shifted, ignore_index=ignore_index, num_items_in_batch=num_items)
    (loss * 1.0).backward()
    tol = TOL[dtype]
    assert relative_error(loss, hf) <= tol
    assert relative_error(x.grad, x_hf.grad) <= tol
    # the same on flat inputs
    flat = cross_entropy(logits.view(-1, vocab), shifted.view(-1), ignore_index=ignore_index,
                         num_items_in_batch=num_items)
    assert relative_error(flat, hf) <= tol


# ---- all rows ignored, gradient accumulation -----------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("options", ["plain", "all", "all+num_items"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_rows_ignored(options, reduction, dtype):
    # documented deviation: "mean" gives 0 (torch and HF give NaN)
    opts = {} if options == "plain" else dict(OPTIONS[options])
    if reduction != "mean":
        opts.pop("num_items_in_batch", None)
    ignore_index = opts.get("ignore_index", -100)
    x = (torch.randn(13, 1000) * 3).to(dtype).requires_grad_()
    target = torch.full((13,), ignore_index)
    out = cross_entropy(x, target, reduction=reduction, **opts)
    loss, z_loss = out if opts.get("return_z_loss") else (out, None)
    (g,) = torch.autograd.grad(loss, x, torch.full(loss.shape, 2.0, dtype=loss.dtype))
    assert torch.isfinite(loss).all() and not loss.any()
    assert torch.isfinite(g).all() and not g.any()
    if z_loss is not None:
        assert torch.isfinite(z_loss).all() and not z_loss.any()


@pytest.mark.parametrize("num_items_type", ["int", "tensor"])
def test_gradient_accumulation_equals_one_big_batch(num_items_type):
    micro, n, vocab = 4, 9, 1000
    logits = torch.randn(micro * n, vocab) * 3
    target = make_target(micro * n, vocab, ignored=(0, 0))
    target[torch.rand(micro * n) < 0.3] = -100  # micro-batches with different numbers of valid rows
    target[n:n + 4] = -100
    total = (target != -100).sum()
    num_items = int(total) if num_items_type == "int" else total
    x = logits.clone().requires_grad_()
    summed = torch.zeros(())
    for i in range(micro):
        rows = slice(i * n, (i + 1) * n)
        loss = cross_entropy(x[rows], target[rows], num_items_in_batch=num_items)
        loss.backward()
        summed += loss.detach()
    y = logits.clone().requires_grad_()
    big = cross_entropy(y, target)
    big.backward()
    yr = logits.clone().requires_grad_()
    ref = cross_entropy_reference(yr, target)
    ref.backward()
    assert relative_error(summed, big) <= 1e-5 and relative_error(big, ref) <= 1e-5
    assert relative_error(x.grad, y.grad) <= 1e-5 and relative_error(y.grad, yr.grad) <= 1e-5


# ---- in-place backward ----------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_logits_untouched_without_inplace_backward(reduction):
    # an intermediate (like the LM head's output), where writing into it would be tempting
    h = torch.randn(13, 33, requires_grad=True)
    w = torch.randn(1000, 33, requires_grad=True)
    logits = h @ w.t()
    before = logits.detach().clone()
    loss = cross_entropy(logits, make_target(13, 1000), reduction=reduction, inplace_backward=False)
    loss.backward(torch.ones_like(loss) if reduction != "none" else bf16_exact_randn(13))
    assert torch.equal(logits.detach(), before)
    # and the default is out-of-place, for leaves and intermediates
    x = before.clone().requires_grad_()
    for t in (x, x * 1.0):
        loss = cross_entropy(t, make_target(13, 1000), reduction=reduction)
        loss.backward(torch.ones_like(loss))
        assert torch.equal(t.detach(), before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_inplace_backward_gradient(reduction, dtype):
    h = torch.randn(13, 33).to(dtype).requires_grad_()
    w = (torch.randn(1000, 33) / 3).to(dtype).requires_grad_()
    target = make_target(13, 1000)
    u = torch.tensor(3.5) if reduction != "none" else bf16_exact_randn(13)
    logits = h @ w.t()
    logits_ptr = logits.data_ptr()
    logits_values = logits.detach().float().clone()
    loss = cross_entropy(logits, target, reduction=reduction, label_smoothing=0.1, inplace_backward=True)
    g_logits, g_h, g_w = torch.autograd.grad(loss, (logits, h, w), u.to(loss.dtype))
    assert g_logits.data_ptr() == logits_ptr  # the gradient lives in the logits' memory
    # reference: fp32, on the very logits the op saw
    xr = logits_values.requires_grad_()
    ref = cross_entropy_reference(xr, target, reduction=reduction, label_smoothing=0.1)
    (gr,) = torch.autograd.grad(ref, xr, u)
    tol = TOL[dtype]
    assert relative_error(loss, ref) <= tol
    assert relative_error(g_logits, gr) <= tol
    assert relative_error(g_h, gr @ w.detach().float()) <= tol
    assert relative_error(g_w, gr.t() @ h.detach().float()) <= tol


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_inplace_backward_allocates_no_gradient_buffer(reduction):
    # the gradient that reaches the logits' producer (here the LM head matmul) is the logits' own memory
    h = torch.randn(13, 33, requires_grad=True)
    w = torch.randn(1000, 33, requires_grad=True)
    logits = h @ w.t()
    logits_ptr = logits.data_ptr()
    seen = []
    logits.register_hook(lambda g: seen.append(g.data_ptr()))
    loss = cross_entropy(logits, make_target(13, 1000), reduction=reduction, inplace_backward=True)
    loss.backward(torch.ones_like(loss))
    assert seen == [logits_ptr]


def test_inplace_backward_is_loud_when_another_op_saved_the_logits():
    # the gradient overwrites the logits: an op that saved them earlier must fail, not read the gradient
    x = torch.randn(13, 1000, requires_grad=True)
    logits = x * 1.0
    other = logits.pow(2).sum()  # pow saves logits for its backward
    loss = cross_entropy(logits, make_target(13, 1000), inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()


def test_inplace_backward_on_a_leaf():
    logits, target = _inputs(13, 1000)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, target, reduction="sum", inplace_backward=True)
    (g,) = torch.autograd.grad(loss, x)
    xr = logits.clone().requires_grad_()
    ref = cross_entropy_reference(xr, target, reduction="sum")
    (gr,) = torch.autograd.grad(ref, xr)
    assert relative_error(loss, ref) <= 1e-5 and relative_error(g, gr) <= 1e-5


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target": torch.zeros(4, dtype=torch.long)}, "shape"),
        ({"target": torch.zeros(5, 2, dtype=torch.long)}, "shape"),
        ({"logits": torch.randint(0, 5, (5, 16))}, "dtype"),
        ({"target": torch.zeros(5)}, "dtype|int64"),
        ({"target": torch.zeros(5, dtype=torch.long, device="meta")}, "device"),
        ({"target": torch.tensor([0, 1, 16, 2, 3])}, "out of range"),
        ({"target": torch.tensor([0, 1, -5, 2, 3])}, "out of range"),
        ({"target": torch.tensor([0, 1, -100, 2, 3]), "ignore_index": -1}, "out of range"),
        ({"logits": torch.randn(0, 16), "target": torch.zeros(0, dtype=torch.long)}, "empty"),
        ({"reduction": "avg"}, "reduction"),
        ({"reduction": "sum", "num_items_in_batch": 4}, "num_items_in_batch"),
        ({"reduction": "none", "num_items_in_batch": torch.tensor(4)}, "num_items_in_batch"),
        ({"softcap": 0.0}, "softcap"),
        ({"softcap": -30.0}, "softcap"),
        ({"logits_scaling": 0.0}, "logits_scaling"),
        ({"logits_scaling": -1.0}, "logits_scaling"),
        ({"label_smoothing": 1.0}, "label_smoothing"),
        ({"label_smoothing": -0.1}, "label_smoothing"),
        ({"logits": torch.randn(16, 5).t(), "inplace_backward": True}, "contiguous"),
    ],
)
def test_bad_input(kwargs, message):
    args = {"logits": torch.randn(5, 16), "target": torch.tensor([0, 1, 15, -100, 3])}
    args.update(kwargs)
    logits, target = args.pop("logits"), args.pop("target")
    with pytest.raises(ValueError, match=f"(?i){message}"):
        cross_entropy(logits, target, **args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_largest_vocabulary_not_a_multiple_of_any_block(dtype):
    # V = 262144 + 3 (the upper size), two rows, one of them ignored-free
    logits = (torch.randn(2, 262147) * 2).to(dtype).requires_grad_()
    target = torch.tensor([262146, 5])
    loss = cross_entropy(logits, target, label_smoothing=0.05)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_in = logits.detach().float().requires_grad_()
    ref = cross_entropy_reference(ref_in, target, label_smoothing=0.05)
    (ref_grad,) = torch.autograd.grad(ref, ref_in)
    assert relative_error(loss, ref) <= TOL[dtype] and relative_error(grad, ref_grad) <= TOL[dtype]
