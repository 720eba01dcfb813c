"""Kernels address elements past 2**31 from a tensor's start (long-context shapes) without int32 wrap-around.

At a million tokens a [tokens, 4096] hidden state, a [1, 32, tokens, 128] q or a [tokens, 14336] MLP activation
holds more than 2**31 elements. Triton forms ``index * stride`` in int32 unless a factor is int64 (it passes an
integer argument >= 2**31 as int64, but a product of two smaller ones stays int32), and an offset that wraps
reads or writes the wrong element, or faults.

Each test hands a kernel a view holding a few rows (or heads) whose strides are those of such a tensor, so
that its largest offset lies past 2**31 while the kernel runs only a few programs. The view lives in an
uninitialised ``torch.empty`` storage of about 8 GiB of which only the view's own elements are written: on
Linux untouched pages take address space, not memory, and Triton's interpreter uses a CPU tensor's storage
as it is (each test asserts that the resident memory stayed small). The view starts 2**31 elements into its
storage, so an offset wrapped to int32 (off by a multiple of 2**32 elements) still points inside it: a wrong
value, not a crash. The result must equal, bit for bit, the same op on a compact copy of the same rows.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from foak.ops.activations import swiglu
from foak.ops.cross_entropy import cross_entropy
from foak.ops.lora import lora_linear
from foak.ops.moe import _combine_op, _gate_forward_op
from foak.ops.rms_norm import rms_norm
from foak.ops.rope import rope

INT32_LIMIT = 2**31
DTYPE = torch.bfloat16  # the smallest element the ops take: the least address space per element
MAX_RESIDENT_GROWTH = 512 * 2**20

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux (lazily mapped pages)")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _resident_memory_stays_small():
    """Fails a test whose huge storages became resident (an interpreter that copied them would do that)."""
    gc.collect()
    before = _resident_bytes()
    yield
    grown = _resident_bytes() - before
    gc.collect()  # the interpreter keeps launch arguments in a reference cycle: free the storages now
    assert grown < MAX_RESIDENT_GROWTH, f"resident memory grew by {grown / 2**20:.0f} MiB"


def far_views(shape, strides, count=1, seed=0, rows=None):
    """``count`` views of ``shape`` and ``strides`` in one uninitialised storage, the first 2**31 elements in,
    the others next to it along the last dimension (the strides leave room for them). Random values in the
    given ``rows`` (indices along the first dimension; default: all), the rest left unwritten."""
    shape, strides = tuple(shape), tuple(strides)
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    assert span > INT32_LIMIT, "the view's largest offset must be past the int32 range"
    assert all(s >= count * shape[-1] for n, s in zip(shape[:-1], strides[:-1]) if n > 1), "views would overlap"
    numel = INT32_LIMIT + count * shape[-1] + span
    try:
        storage = torch.empty(numel, dtype=DTYPE)
    except RuntimeError as e:  # e.g. strict overcommit (vm.overcommit_memory=2) refuses the address space
        pytest.skip(f"cannot reserve {numel * DTYPE.itemsize / 2**30:.1f} GiB of address space: {e}")
    gen = torch.Generator().manual_seed(seed)
    views = []
    for i in range(count):
        view = storage.as_strided(shape, strides, INT32_LIMIT + i * shape[-1])
        if rows is None:
            view.copy_(torch.randn(shape, generator=gen))
        else:
            for r in rows:
                view[r].copy_(torch.randn(shape[1:], generator=gen))
        views.append(view)
    return views


def rows_apart(n_rows: int, n_cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(shape, strides) of n_rows rows of a [tokens, n_cols] tensor, the fewest tokens apart that put the
    last row's start past 2**31."""
    tokens_apart = INT32_LIMIT // ((n_rows - 1) * n_cols) + 1
    return (n_rows, n_cols), (tokens_apart * n_cols, 1)


def assert_same(got, expected):
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.equal(g, e), f"max difference {(g.float() - e.float()).abs().max().item()}"


def test_rope_q_heads_past_int32():
    """The first positions of a contiguous q [1, 32, 544000, 128]: head 31 starts at 2.16e9 elements (2**31 is
    passed from 541,201 tokens on with 32 heads of 128); forward and backward (a gradient in that layout)."""
    seq_len, heads, head_dim, positions = 544_000, 32, 128, 3
    shape = (1, heads, positions, head_dim)
    strides = (heads * seq_len * head_dim, seq_len * head_dim, head_dim, 1)
    (q_far,) = far_views(shape, strides)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(1, 8, positions, head_dim, generator=gen).to(DTYPE)
    angles = torch.rand(1, positions, head_dim // 2, generator=gen) * 6.3
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
    assert_same(rope(q_far, k, cos, sin), rope(q_far.contiguous(), k, cos, sin))

    def grads(dq):
        q = torch.zeros(shape, dtype=DTYPE, requires_grad=True)
        k_ = k.clone().requires_grad_()
        q_out, k_out = rope(q, k_, cos, sin)
        return torch.autograd.grad((q_out, k_out), (q, k_), (dq, torch.ones_like(k_out)))

    assert_same(grads(q_far), grads(q_far.contiguous()))


def test_rms_norm_rows_past_int32():
    """Rows of a [1M, 4096] hidden state 262,145 tokens apart: the third starts at 2.15e9 elements. Forward with a
    residual, and the backward with the incoming gradient in that layout."""
    shape, strides = rows_apart(3, 4096)
    x_far, dy_far = far_views(shape, strides, count=2)
    gen = torch.Generator().manual_seed(1)
    residual = torch.randn(shape, generator=gen).to(DTYPE)
    weight = (1 + 0.1 * torch.randn(shape[1], generator=gen)).to(DTYPE)
    assert_same(rms_norm(x_far, weight, residual=residual), rms_norm(x_far.contiguous(), weight, residual=residual))

    def grads(x, dy):
        x = x.detach().requires_grad_()
        w = weight.clone().requires_grad_()
        return torch.autograd.grad(rms_norm(x, w, inplace_backward=False), (x, w), dy)

    assert_same(grads(x_far, dy_far), grads(x_far.contiguous(), dy_far.contiguous()))


def test_swiglu_rows_past_int32():
    """Rows of [tokens, 14336] gate and up activations 74,899 tokens apart (the third at 2.15e9 elements),
    forward and backward."""
    shape, strides = rows_apart(3, 14336)
    g_far, u_far, dh_far = far_views(shape, strides, count=3)

    def run(g, u, dh):
        g, u = g.detach().requires_grad_(), u.detach().requires_grad_()
        h = swiglu(g, u, inplace_backward=False)
        return (h, *torch.autograd.grad(h, (g, u), dh))

    assert_same(run(g_far, u_far, dh_far), run(g_far.contiguous(), u_far.contiguous(), dh_far.contiguous()))


@pytest.mark.parametrize("reduction", ["mean", "none"])  # gradient in the forward / in the backward
def test_cross_entropy_rows_past_int32(reduction):
    """Rows of [tokens, 128256] logits (Llama 3's vocabulary; 2**31 elements are 16,744 tokens) 8,373 tokens apart:
    the third starts at 2.15e9 elements."""
    shape, strides = rows_apart(3, 128256)
    (logits_far,) = far_views(shape, strides)
    target = torch.tensor([5, 128255, 77_000])

    def run(logits):
        logits = logits.detach().requires_grad_()
        loss = cross_entropy(logits, target, reduction=reduction)
        return (loss, *torch.autograd.grad(loss.sum(), logits))

    assert_same(run(logits_far), run(logits_far.contiguous()))


def test_lora_dropout_rows_past_int32():
    """LoRA with dropout on rows of a [1M, 4096] input 262,145 tokens apart (the kernels read x at 2.15e9
    elements): output and the gradients of x and lora_A (the backward regenerates the mask from x's rows)."""
    shape, strides = rows_apart(3, 4096)
    (x_far,) = far_views(shape, strides)
    gen = torch.Generator().manual_seed(1)
    weight = (0.02 * torch.randn(64, shape[1], generator=gen)).to(DTYPE)
    lora_A = (0.02 * torch.randn(8, shape[1], generator=gen)).to(DTYPE)
    lora_B = (0.02 * torch.randn(64, 8, generator=gen)).to(DTYPE)
    dout = torch.randn(shape[0], 64, generator=gen).to(DTYPE)

    def run(x):
        x, a = x.detach().requires_grad_(), lora_A.clone().requires_grad_()
        out = lora_linear(x, weight, None, a, lora_B, 2.0, dropout_p=0.25, seed=1234)
        return (out, *torch.autograd.grad(out, (x, a), dout))

    assert_same(run(x_far), run(x_far.contiguous()))


def test_moe_combine_rows_past_int32():
    """MoE experts' combine reads rows of y [S, 4096] in expert order (S = tokens * k: 2**31 elements are 524,288
    pairs, 65,536 tokens at k = 8) at positions past 2.15e9 elements, and near the start."""
    n_cols = 4096
    rows = INT32_LIMIT // n_cols + 3
    pos = torch.tensor([[rows - 1, 0], [rows - 3, rows - 2], [7, rows - 1]])
    (y,) = far_views((rows, n_cols), (n_cols, 1), rows=pos.unique().tolist())
    w = torch.rand(pos.shape, generator=torch.Generator().manual_seed(1))
    compact_rows, compact_pos = torch.unique(pos, return_inverse=True)
    assert_same([_combine_op(y, pos, w, DTYPE)], [_combine_op(y[compact_rows], compact_pos, w, DTYPE)])


@pytest.mark.parametrize("interleaved", [False, True])
def test_moe_gate_rows_past_int32(interleaved):
    """The gate of the expert MLP (gpt-oss's clamped SwiGLU) on rows of h [S, 2 * 2880] far apart: the third row
    of h starts at 2.15e9 elements."""
    shape, strides = rows_apart(3, 2 * 2880)
    (h_far,) = far_views(shape, strides)
    assert_same([_gate_forward_op(h_far, "clamped_swiglu", interleaved, 1.702, 7.0)],
                [_gate_forward_op(h_far.contiguous(), "clamped_swiglu", interleaved, 1.702, 7.0)])
