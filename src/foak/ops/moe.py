"""Mixture-of-experts experts block for training: ``out[t] = sum_j w[t, j] * E_{e(t, j)}(x[t])`` with the
gated expert MLP ``E_e(x) = (act(x G_e^T) * (x U_e^T)) D_e^T``, forward and backward.

Weights in the transformers 5.x layout (Mixtral, Qwen3-MoE, GraniteMoE experts): ``gate_up_proj``
``[E, 2I, H]`` (rows ``:I`` the gate ``G_e``, rows ``I:`` the up projection ``U_e``), ``down_proj``
``[E, H, I]``. Routing as the router returns it: ``top_k_index`` ``[T, k]`` (int) and ``top_k_weights``
``[T, k]``.

Options (gpt-oss's experts use all of them): ``transposed=True`` takes ``gate_up_proj [E, H, 2I]`` and
``down_proj [E, I, H]`` (the GEMMs read them as they are: no copy, the operands of each GEMM are swapped
instead); ``interleaved=True`` reads the gate and up columns of ``h = x [G|U]^T`` alternately (gate ``2j``,
up ``2j + 1``) in the activation kernel's loads (no permutation of ``h`` or of the weights); biases
``gate_up_bias [E, 2I]`` (added to ``h``) and ``down_bias [E, H]`` (added to ``y`` before the routing
weight); ``activation="clamped_swiglu"`` with ``alpha`` and ``limit``:
``g' = min(g, limit)``, ``u' = clamp(u, -limit, limit)``, ``a = (u' + 1) * g' * sigmoid(alpha * g')``, whose
gradient is zero where a clamp is active (``g > limit``, ``|u| > limit``; the boundary itself passes, as
``torch.clamp``'s does).

How it runs (S = T * k token-expert pairs):

1. the pairs are sorted by expert (stable), ``offs`` = cumulative tokens per expert (on the device, no host
   synchronisation), the rows of ``x`` gathered into expert order ``xs [S, H]``;
2. ``h = xs G|U^T`` per expert (one grouped GEMM, ``[S, 2I]``), ``a = act(h[:, :I]) * h[:, I:]`` (foak's GLU
   kernel on the two halves in place), ``y = a D^T`` per expert (grouped GEMM, ``[S, H]``);
3. a Triton kernel combines back to token order: ``out[t] = sum_j w[t, j] y[pos(t, j)]`` in fp32, with no
   scatter and no atomics (each token reads its k rows).

Saved for the backward: ``h`` and ``y`` (and the small index tensors; with ``recompute_h`` only ``y``, ``h``
recomputed by one more grouped GEMM); ``xs`` is gathered again from ``x`` and
``a`` recomputed from ``h`` by the GLU backward kernel, which writes ``dh`` over ``h`` and ``a`` over ``da``
(so one backward per forward: a second one through the same graph is an error; the interleaved and clamped
gates use their own kernel with the same in-place contract): the ``[S, I]`` activation
and the ``[S, H]`` permuted input are not kept, and the backward allocates no second ``[S, 2I]`` buffer. The backward's combine kernel forms ``dy[pos(t, j)] = w[t, j]
dout[t]`` and the routing-weight gradient ``dw[t, j] = <dout[t], y[pos(t, j)]>`` in one pass over ``dout``.

Biases: the per-expert GEMM loop adds them in its ``addmm`` (no temporary); after ``torch._grouped_mm`` the
rows' biases are gathered once (an ``[S, 2I]`` and an ``[S, H]`` temporary, as transformers' grouped_mm does).
Their gradients are per-expert column sums of ``dh`` / ``dy``: per group in fp32 in the loop, by one fp32
``index_add_`` (an fp32 copy of ``dh`` / ``dy`` for bf16 inputs) with ``torch._grouped_mm`` or compiled.

GEMMs: ``torch._grouped_mm`` (cuBLAS/CUTLASS grouped GEMM) for bf16 on CUDA where torch has it (the same
kernel transformers' ``grouped_mm`` backend calls); otherwise (fp32, fp16, CPU) one ``torch.mm`` per expert
with tokens, which needs the per-expert counts on the host (one synchronisation per call). Under autocast
the weights and input are cast to the autocast dtype, as ``nn.Linear`` would (gradients flow back to the
weights' own dtype).

torch.compile (fullgraph) traces the routing bookkeeping as torch ops and each kernel launch as a custom op
(``torch.ops.foak.moe_combine``, ``moe_combine_backward``, ``glu_forward``, ``moe_glu_backward``);
``torch._grouped_mm`` is traced as it is, and the per-expert loop runs inside ``moe_grouped_mm`` /
``moe_grouped_mm_weight``, which read the group sizes when they run (one synchronisation per GEMM instead of
one per forward and backward). Compiled, the backward writes into new buffers instead of over the saved
``h`` and ``da``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foak.backend import use_triton
from foak.ops._checks import check_not_sharded
from foak.ops._custom_op import autograd_inside_op, custom_op
from foak.ops.activations import (ACTIVATIONS, _activation_and_grad, _backward_launch, _ACT_ID, _glu_forward_op,
                                  glu_reference)

GATES = (*ACTIVATIONS, "clamped_swiglu")  # moe_experts' activations (the last: gpt-oss's, with alpha and limit)

# recompute_h: the backward recomputes h = xs [G|U]^T (one more grouped GEMM, a third of the forward's FLOPs)
# instead of keeping the [S, 2I] product from the forward (moe_experts' recompute_h=None reads this)
TUNING = {"block_h": 1024, "warps": 4, "recompute_h": False}


# 1. reference -------------------------------------------------------------------------------------
def gate_reference(h, activation="silu", interleaved=False, alpha=None, limit=None):
    """The gate of the expert MLP on ``h [S, 2I]`` (fp32 inside, cast back to ``h``'s dtype): ``act(g) * u`` or,
    for ``"clamped_swiglu"``, ``(clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')`` with ``g' = min(g,
    limit)``; gate/up columns concatenated (``[:I] | [I:]``) or interleaved (``0::2`` / ``1::2``)."""
    if interleaved:
        g, u = h[..., 0::2], h[..., 1::2]
    else:
        g, u = h.chunk(2, dim=-1)
    if activation != "clamped_swiglu":
        return glu_reference(g, u, activation)
    g, u = g.float().clamp(max=limit), u.float().clamp(-limit, limit)
    return ((u + 1) * (g * torch.sigmoid(alpha * g))).to(h.dtype)


def moe_experts_reference(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation="silu",
                          gate_up_bias=None, down_bias=None, interleaved=False, transposed=False, alpha=None,
                          limit=None):
    """A loop over experts in plain torch (fp32 accumulation of the combine, as this op does)."""
    T, H = hidden.shape
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden.device)
    for e in range(gate_up_proj.shape[0]):
        token, slot = torch.where(top_k_index == e)
        if token.numel() == 0:
            continue
        h = hidden[token] @ (gate_up_proj[e] if transposed else gate_up_proj[e].t())
        if gate_up_bias is not None:
            h = h + gate_up_bias[e]
        a = gate_reference(h, activation, interleaved, alpha, limit)
        y = a @ (down_proj[e] if transposed else down_proj[e].t())
        if down_bias is not None:
            y = y + down_bias[e]
        out = out.index_add(0, token, y.float() * top_k_weights[token, slot, None].float())
    return out.to(hidden.dtype)


# 2. kernels ---------------------------------------------------------------------------------------
@triton.jit
def _combine_kernel(Y, POS, W, OUT, H, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr):
    # out[t, cols] = sum_j w[t, j] * y[pos[t, j], cols]  (fp32), one program per (token, column block)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(K):
        p = tl.load(POS + t * K + j).to(tl.int64)
        y = tl.load(Y + p * H + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            y = y * tl.load(W + t * K + j).to(tl.float32)
        acc += y
    tl.store(OUT + t * H + cols, acc.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _combine_backward_kernel(DOUT, Y, POS, W, DY, DW, H, K: tl.constexpr, K_POW2: tl.constexpr,
                             BLOCK_H: tl.constexpr):
    # per token t: dy[pos[t, j]] = w[t, j] * dout[t]; dw[t, j] = <dout[t], y[pos[t, j]]> (fp32 sums)
    t = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, K_POW2)
    dw = tl.zeros((K_POW2,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        ok = cols < H
        dout = tl.load(DOUT + t * H + cols, mask=ok, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            p = tl.load(POS + t * K + j).to(tl.int64)
            w = tl.load(W + t * K + j).to(tl.float32)
            y = tl.load(Y + p * H + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(DY + p * H + cols, (w * dout).to(DY.dtype.element_ty), mask=ok)
            dw = tl.where(slots == j, dw + tl.sum(dout * y, axis=0), dw)
    tl.store(DW + t * K + slots, dw.to(DW.dtype.element_ty), mask=slots < K)


@triton.jit
def _gate_kernel(H, h_stride, DA, da_stride, DH, A, n_cols, n_col_blocks, alpha, limit,
                 ACT: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    # h [S, 2I] -> a [S, I] (forward, into A); backward: dh [S, 2I] into DH and a into A from h and da. DH may be
    # H and A may be DA: each element is read before the same thread overwrites it. DH shares h's strides, A da's.
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    if INTERLEAVED:  # gate column 2j, up column 2j + 1
        gate_cols = 2 * cols
        up_cols = 2 * cols + 1
    else:  # gate columns :I, up columns I:
        gate_cols = cols
        up_cols = cols + n_cols
    g = tl.load(H + row * h_stride + gate_cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(H + row * h_stride + up_cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 3:  # clamped SwiGLU: (clamp(u, -limit, limit) + 1) * g' sigmoid(alpha g'), g' = min(g, limit)
        gc = tl.where(g > limit, limit, g)
        uc = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
        s = tl.sigmoid(alpha * gc)
        glu = gc * s
        a = (uc + 1.0) * glu
        # torch.clamp's gradient: 1 inside the closed range, 0 where the clamp is active
        d_gate = tl.where(g > limit, 0.0, (uc + 1.0) * (s + alpha * gc * s * (1.0 - s)))
        d_up = tl.where((u > limit) | (u < -limit), 0.0, glu)
    else:
        act, d_act = _activation_and_grad(g, ACT, BACKWARD)
        a = act * u
        d_gate = u * d_act
        d_up = act
    if BACKWARD:
        da = tl.load(DA + row * da_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DH + row * h_stride + gate_cols, (da * d_gate).to(DH.dtype.element_ty), mask=mask)
        tl.store(DH + row * h_stride + up_cols, (da * d_up).to(DH.dtype.element_ty), mask=mask)
    tl.store(A + row * da_stride + cols, a.to(A.dtype.element_ty), mask=mask)


def _gate_launch(h, da, dh, a, activation, interleaved, alpha, limit, backward):
    n_rows, n_cols = a.shape
    if n_rows * n_cols == 0:
        return
    block = min(TUNING["block_h"], triton.next_power_of_2(n_cols))
    n_col_blocks = triton.cdiv(n_cols, block)
    act = 3 if activation == "clamped_swiglu" else _ACT_ID[activation]
    _gate_kernel[(n_rows * n_col_blocks,)](
        h, h.stride(0), da, a.stride(0), dh, a, n_cols, n_col_blocks,
        float(alpha if alpha is not None else 0.0), float(limit if limit is not None else 0.0),
        ACT=act, INTERLEAVED=bool(interleaved), BACKWARD=bool(backward), BLOCK=block, num_warps=TUNING["warps"])


def _gate_forward_fake(h, activation, interleaved, alpha, limit):
    return h.new_empty((h.shape[0], h.shape[1] // 2))


@custom_op("moe_gate_forward", _gate_forward_fake)
def _gate_forward_op(h: torch.Tensor, activation: str, interleaved: bool, alpha: float, limit: float) -> torch.Tensor:
    a = h.new_empty((h.shape[0], h.shape[1] // 2))
    _gate_launch(h, a, h, a, activation, interleaved, alpha, limit, backward=False)
    return a


def _gate_forward(h, activation, interleaved, alpha, limit):
    """a [S, I] from h [S, 2I] (contiguous) for the interleaved or clamped gates."""
    if use_triton(h.device):
        return _gate_forward_op(h, activation, interleaved, _number(alpha), _number(limit))
    return gate_reference(h, activation, interleaved, alpha, limit)


def _number(x) -> float:
    return 0.0 if x is None else float(x)


def _gate_backward_fake(da, h, activation, interleaved, alpha, limit):
    return torch.empty_like(h), torch.empty_like(da)


@custom_op("moe_gate_backward", _gate_backward_fake)
def _gate_backward_op(da: torch.Tensor, h: torch.Tensor, activation: str, interleaved: bool, alpha: float,
                      limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, a) into new buffers (the compiled backward's and the reference backend's form)."""
    if use_triton(h.device):
        dh, a = torch.empty_like(h), torch.empty_like(da)
        _gate_launch(h, da, dh, a, activation, interleaved, alpha, limit, backward=True)
        return dh, a
    with autograd_inside_op():
        h_ = h.detach().requires_grad_()
        a_ = gate_reference(h_, activation, interleaved, alpha, limit)
        (dh,) = torch.autograd.grad(a_, (h_,), da)
    return dh, a_.detach().contiguous()


def _combine_fake(y, pos, w, out_dtype):
    return y.new_empty((pos.shape[0], y.shape[1]), dtype=out_dtype)


@custom_op("moe_combine", _combine_fake)
def _combine_op(y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    T, K = pos.shape
    H = y.shape[1]
    out = torch.empty((T, H), dtype=out_dtype, device=y.device)
    if T == 0:
        return out
    block = min(TUNING["block_h"], triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block))](
        y, pos, w if w is not None else y, out, H, K=K, HAS_W=w is not None, BLOCK_H=block, num_warps=TUNING["warps"])
    return out


def _combine(y, pos, w, out_dtype):
    """[S, H] rows in expert order -> [T, H]: sum over each token's k rows, weighted by w when given."""
    if use_triton(y.device):
        return _combine_op(y, pos, w, out_dtype)
    T, K = pos.shape
    rows = y[pos.reshape(-1)].view(T, K, y.shape[1]).float()
    if w is not None:
        rows = rows * w.float()[:, :, None]
    return rows.sum(1).to(out_dtype)


def _combine_backward_fake(dout, y, pos, w):
    return torch.empty_like(y), w.new_empty(pos.shape)


@custom_op("moe_combine_backward", _combine_backward_fake)
def _combine_backward_op(dout: torch.Tensor, y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = pos.shape
    H = y.shape[1]
    dy = torch.empty_like(y)
    dw = torch.empty((T, K), dtype=w.dtype, device=w.device)
    if T == 0:
        return dy, dw
    block = min(TUNING["block_h"], triton.next_power_of_2(H))
    _combine_backward_kernel[(T,)](dout, y, pos, w, dy, dw, H, K=K, K_POW2=triton.next_power_of_2(K),
                                   BLOCK_H=block, num_warps=TUNING["warps"])
    return dy, dw


def _combine_backward(dout, y, pos, w):
    """(dy [S, H] in expert order, dw [T, k])."""
    if use_triton(y.device):
        return _combine_backward_op(dout, y, pos, w)
    T, K = pos.shape
    flat = pos.reshape(-1)
    d = dout.float()
    dy = torch.empty_like(y)
    dy[flat] = (d[:, None, :] * w.float()[:, :, None]).reshape(T * K, -1).to(dy.dtype)
    dw = (y[flat].float().view(T, K, -1) * d[:, None, :]).sum(-1).to(w.dtype)
    return dy, dw


# 3. grouped GEMMs ---------------------------------------------------------------------------------
def _use_grouped_mm(*tensors) -> bool:
    t = tensors[0]
    return (t.device.type == "cuda" and hasattr(torch, "_grouped_mm") and all(x.dtype == torch.bfloat16 for x in tensors)
            and all(x.shape[-1] % 8 == 0 for x in tensors))


def _group_sizes(offs) -> list[int]:
    """Rows per expert on the host (one synchronisation) from the cumulative ends ``offs``."""
    return torch.diff(offs, prepend=offs.new_zeros(1)).tolist()


def _gmm_loop(a, b, counts, bias=None):
    out = a.new_empty((a.shape[0], b.shape[-1]))
    start = 0
    for e, c in enumerate(counts):
        if c:
            if bias is None:
                torch.mm(a[start:start + c], b[e], out=out[start:start + c])
            else:
                torch.addmm(bias[e], a[start:start + c], b[e], out=out[start:start + c])
        start += c
    return out


def _gmm_weight_loop(a, b, counts, n_experts):
    out = a.new_zeros((n_experts, a.shape[1], b.shape[1]))
    start = 0
    for e, c in enumerate(counts):
        if c:
            torch.mm(a[start:start + c].t(), b[start:start + c], out=out[e])
        start += c
    return out


# While torch.compile traces, the per-expert loop runs inside these ops: its host read of the group sizes
# happens when the op runs, not while dynamo traces (where it would be a graph break).
def _gmm_fake(a, b, offs, bias=None):
    return a.new_empty((a.shape[0], b.shape[-1]))


@custom_op("moe_grouped_mm", _gmm_fake)
def _gmm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _gmm_loop(a, b, _group_sizes(offs), bias)


def _gmm_weight_fake(a, b, offs, n_experts):
    return a.new_empty((n_experts, a.shape[1], b.shape[1]))


@custom_op("moe_grouped_mm_weight", _gmm_weight_fake)
def _gmm_weight_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, n_experts: int) -> torch.Tensor:
    return _gmm_weight_loop(a, b, _group_sizes(offs), n_experts)


def _gmm(a, b, offs, counts, bias=None, row_expert=None):
    """Rows of ``a`` [S, K] in expert groups (``offs``) times ``b[e]`` [K, N] (+ ``bias[e]`` [N]) -> [S, N].
    ``counts``: a function returning the group sizes on the host (read once per forward and backward), None
    while compiling; ``row_expert`` [S]: the expert of each row (needed with a bias)."""
    if _use_grouped_mm(a, b):
        out = torch._grouped_mm(a, b, offs=offs)
        return out if bias is None else out.add_(bias[row_expert])
    if counts is None:
        return _gmm_op(a, b, offs, bias)
    return _gmm_loop(a, b, counts(), bias)


def _group_sum(x, counts, row_expert, n_experts, dtype):
    """Per expert group e: the column sums of x's rows [S, N] -> [E, N] in ``dtype`` (fp32 sums)."""
    out = torch.zeros((n_experts, x.shape[1]), dtype=torch.float32, device=x.device)
    if counts is None or _use_grouped_mm(x):  # no host group sizes (compiled, or the grouped-GEMM path)
        out.index_add_(0, row_expert, x.float())
    else:
        start = 0
        for e, c in enumerate(counts()):
            if c:
                torch.sum(x[start:start + c], 0, dtype=torch.float32, out=out[e])
            start += c
    return out.to(dtype)


def _gmm_weight(a, b, offs, counts, n_experts):
    """Per expert group e: ``a_e^T b_e`` with a [S, M], b [S, N] -> [E, M, N] (zero for experts without rows)."""
    if _use_grouped_mm(a, b):
        return torch._grouped_mm(a.t(), b, offs=offs)
    if counts is None:
        return _gmm_weight_op(a, b, offs, n_experts)
    return _gmm_weight_loop(a, b, counts(), n_experts)


def _glu_backward_fake(da, h, activation):
    return torch.empty_like(h), torch.empty_like(da)


@custom_op("moe_glu_backward", _glu_backward_fake)
def _glu_backward_op(da: torch.Tensor, h: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh = [dg | du], a = act(g) * u) from h = [g | u] and da, into new buffers (the compiled backward's
    form of the in-place kernel call)."""
    inter = da.shape[1]
    g, u = h[:, :inter], h[:, inter:]
    dh = torch.empty_like(h)
    if use_triton(h.device):
        a = torch.empty_like(da)
        _backward_launch(da, g, u, dh[:, :inter], dh[:, inter:], activation, h=a)
        return dh, a
    with autograd_inside_op():
        g_, u_ = g.detach().requires_grad_(), u.detach().requires_grad_()
        a_ = glu_reference(g_, u_, activation)
        dg, du = torch.autograd.grad(a_, (g_, u_), da)
    dh[:, :inter], dh[:, inter:] = dg, du
    return dh, a_.detach().contiguous()


# 4. autograd --------------------------------------------------------------------------------------
def _host_counts(per_expert, cache: list):
    """The group sizes on the host, read once (one synchronisation) for a forward and its backward."""

    def counts():
        if not cache:
            cache.extend(per_expert.tolist())
        return cache

    return counts


class _MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, out_dtype,
                recompute_h, gate_up_bias, down_bias, interleaved, transposed, alpha, limit):
        T, K = top_k_index.shape
        E = gate_up_proj.shape[0]
        # [E, H, 2I] and [E, I, H] views (no copy) whichever way the weights are stored
        w_gu = gate_up_proj if transposed else gate_up_proj.transpose(1, 2)
        w_down = down_proj if transposed else down_proj.transpose(1, 2)
        inter = w_down.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # sorted position -> pair index t * K + j
        pos = torch.empty_like(order)
        pos[order] = torch.arange(order.numel(), device=order.device)  # pair -> sorted position
        # tokens per expert without a host synchronisation (bincount would size its output from the max id);
        # an id outside 0..E-1 fails here (index error on the CPU, device-side assert on CUDA)
        per_expert = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
        offs = torch.cumsum(per_expert, 0, dtype=torch.int32)
        has_bias = gate_up_bias is not None or down_bias is not None
        row_expert = flat[order] if has_bias else None  # the expert of each sorted row
        # compiled: no host list kept on ctx; the per-expert GEMM loop reads the sizes inside its custom op
        compiling = torch.compiler.is_compiling()
        cache = None if compiling else []
        counts = None if compiling else _host_counts(per_expert, cache)
        src = order // K  # token of each sorted row
        xs = hidden[src]
        h = _gmm(xs, w_gu, offs, counts, gate_up_bias, row_expert)  # [S, 2I]
        custom_gate = interleaved or activation not in ACTIVATIONS
        if custom_gate:
            a = _gate_forward(h, activation, interleaved, alpha, limit)
        else:
            a = _glu_forward_op(h[:, :inter], h[:, inter:], activation) if use_triton(h.device) else \
                glu_reference(h[:, :inter], h[:, inter:], activation)
        y = _gmm(a, w_down, offs, counts, down_bias, row_expert)  # [S, H]
        del a, xs
        pos = pos.view(T, K)
        out = _combine(y, pos, top_k_weights, out_dtype)
        ctx.recompute_h = recompute_h
        if recompute_h:
            del h
            h = None
        ctx.save_for_backward(hidden, top_k_weights, gate_up_proj, down_proj, h, y, pos, src, offs, per_expert,
                              gate_up_bias, down_bias, row_expert)
        ctx.activation = activation
        ctx.gate = (custom_gate, interleaved, transposed, _number(alpha), _number(limit))
        ctx.host_counts = cache
        ctx.consumed = False
        return out

    @staticmethod
    def backward(ctx, dout):
        # compiled, the backward computes into new buffers (the traced graph owns its memory): no in-place
        # GLU backward, so no one-backward-per-forward limit either
        compiling = torch.compiler.is_compiling()
        if not compiling:
            if ctx.consumed:
                raise RuntimeError("moe_experts: backward ran twice through the same forward (retain_graph=True); "
                                   "its backward overwrites the saved [S, 2I] activations with their gradient to "
                                   "save memory, so run the forward again instead")
            ctx.consumed = True
        (hidden, w, gate_up_proj, down_proj, h, y, pos, src, offs, per_expert, gate_up_bias, down_bias,
         row_expert) = ctx.saved_tensors
        custom_gate, interleaved, transposed, alpha, limit = ctx.gate
        counts = None if compiling else _host_counts(per_expert, ctx.host_counts)
        w_gu = gate_up_proj if transposed else gate_up_proj.transpose(1, 2)  # [E, H, 2I]
        w_down = down_proj if transposed else down_proj.transpose(1, 2)  # [E, I, H]
        E, inter = gate_up_proj.shape[0], w_down.shape[1]
        dout = dout.contiguous()
        dy, dw = _combine_backward(dout, y, pos, w)
        del y
        d_down_bias = _group_sum(dy, counts, row_expert, E, down_bias.dtype) if ctx.needs_input_grad[9] else None
        da = _gmm(dy, w_down.transpose(1, 2), offs, counts)  # [S, I]
        if ctx.recompute_h:
            h = _gmm(hidden[src], w_gu, offs, counts, gate_up_bias, row_expert)
        if custom_gate:
            if use_triton(h.device) and not compiling:  # in place, as below: dh over h, a over da
                _gate_launch(h, da, h, da, ctx.activation, interleaved, alpha, limit, backward=True)
                dh, a = h, da
            else:
                dh, a = _gate_backward_op(da, h, ctx.activation, interleaved, alpha, limit)
        elif use_triton(h.device) and not compiling:
            # in place: dh over h (this op's own buffer) and a = act(g) * u over da; each element is read
            # before the same thread overwrites it
            g, u = h[:, :inter], h[:, inter:]
            _backward_launch(da, g, u, g, u, ctx.activation, h=da)
            dh, a = h, da
        else:
            dh, a = _glu_backward_op(da, h, ctx.activation)
        d_down = None
        if ctx.needs_input_grad[4]:  # [E, I, H] transposed, else [E, H, I]
            d_down = _gmm_weight(a, dy, offs, counts, E) if transposed else _gmm_weight(dy, a, offs, counts, E)
        del a, da, dy
        d_gate_up_bias = _group_sum(dh, counts, row_expert, E, gate_up_bias.dtype) if ctx.needs_input_grad[8] \
            else None
        xs = hidden[src]
        d_gate_up = None
        if ctx.needs_input_grad[3]:  # [E, H, 2I] transposed, else [E, 2I, H]
            d_gate_up = _gmm_weight(xs, dh, offs, counts, E) if transposed else _gmm_weight(dh, xs, offs, counts, E)
        del xs
        d_hidden = None
        if ctx.needs_input_grad[0]:
            dxs = _gmm(dh, w_gu.transpose(1, 2), offs, counts)  # [S, H]
            d_hidden = _combine(dxs, pos, None, hidden.dtype)
        return (d_hidden, None, dw if ctx.needs_input_grad[2] else None, d_gate_up, d_down, None, None, None,
                d_gate_up_bias, d_down_bias, None, None, None, None)


# 5. public function -------------------------------------------------------------------------------
def _check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, gate_up_bias=None,
           down_bias=None, transposed=False, alpha=None, limit=None):
    op = "moe_experts"
    for name, t in (("hidden", hidden), ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        check_not_sharded(op, name, t)
    for name, t in (("hidden", hidden), ("top_k_weights", top_k_weights), ("gate_up_proj", gate_up_proj),
                    ("down_proj", down_proj)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{op}: {name} must be a floating-point tensor, got "
                             + (str(t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__))
    if not isinstance(top_k_index, torch.Tensor) or top_k_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: top_k_index must be an int64/int32 tensor [tokens, k]")
    if hidden.dim() != 2:
        raise ValueError(f"{op}: hidden must be [tokens, hidden_size], got shape {tuple(hidden.shape)}")
    T, H = hidden.shape
    layout = "gate_up_proj [E, H, 2I] and down_proj [E, I, H]" if transposed else \
        "gate_up_proj [E, 2I, H] and down_proj [E, H, I]"
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(f"{op}: expected {layout}; got {tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
    if transposed:
        E, h_in, two_i = gate_up_proj.shape
        down_shape = (E, two_i // 2, H)
    else:
        E, two_i, h_in = gate_up_proj.shape
        down_shape = (E, H, two_i // 2)
    if h_in != H or two_i % 2 or tuple(down_proj.shape) != down_shape:
        raise ValueError(f"{op}: expected {layout.replace('H', f'H={H}')}; got {tuple(gate_up_proj.shape)} and "
                         f"{tuple(down_proj.shape)} (transposed={transposed})")
    for name, b, shape in (("gate_up_bias", gate_up_bias, (E, two_i)), ("down_bias", down_bias, (E, H))):
        if b is not None and (not isinstance(b, torch.Tensor) or not b.is_floating_point()
                              or tuple(b.shape) != shape):
            raise ValueError(f"{op}: {name} must be a floating-point tensor {list(shape)}, got "
                             + (str(tuple(b.shape)) if isinstance(b, torch.Tensor) else type(b).__name__))
        if b is not None:
            check_not_sharded(op, name, b)
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T or tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"{op}: top_k_index and top_k_weights must both be [tokens={T}, k]; got "
                         f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
    if activation not in GATES:
        raise ValueError(f"{op}: activation must be one of {GATES}, got {activation!r}")
    if activation == "clamped_swiglu":
        for name, v in (("alpha", alpha), ("limit", limit)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not float("-inf") < v < float("inf"):
                raise ValueError(f"{op}: clamped_swiglu needs a finite number {name}, got {v!r}")
        if limit <= 0:
            raise ValueError(f"{op}: clamped_swiglu needs limit > 0, got {limit}")
    elif alpha is not None or limit is not None:
        raise ValueError(f"{op}: alpha and limit belong to activation='clamped_swiglu', not {activation!r}")
    tensors = [t for t in (hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
               if t is not None]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(str(d) for d in devices)}")


def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, activation: str = "silu",
                recompute_h: bool | None = None, *, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, interleaved: bool = False, transposed: bool = False,
                alpha: float | None = None, limit: float | None = None) -> torch.Tensor:
    """The experts block of an MoE layer (see the module docstring): ``hidden`` ``[T, H]``, ``top_k_index``
    ``[T, k]`` (expert ids in ``0..E-1``), ``top_k_weights`` ``[T, k]``, ``gate_up_proj`` ``[E, 2I, H]``,
    ``down_proj`` ``[E, H, I]`` (``transposed=True``: ``[E, H, 2I]`` and ``[E, I, H]``); ``activation`` of the
    gate: "silu" (SwiGLU), "gelu" or "gelu_tanh" (GeGLU), or "clamped_swiglu" (gpt-oss: needs ``alpha`` and
    ``limit``); ``interleaved``: gate and up columns alternate in ``gate_up_proj``'s output; ``gate_up_bias``
    ``[E, 2I]`` and ``down_bias`` ``[E, H]``: per-expert biases (the latter added before the routing weight).
    Returns ``[T, H]`` in ``hidden``'s dtype; under autocast the GEMMs run in the autocast dtype and the
    fp32 combine is rounded once, to ``hidden``'s dtype (as transformers' experts accumulate into it).
    ``recompute_h``: keep no ``[S, 2I]`` tensor from the forward to the backward, recomputing it there with
    one more grouped GEMM (default ``TUNING["recompute_h"]``). Differentiable in
    ``hidden``, ``top_k_weights``, both weights and both biases. An expert id outside ``0..E-1`` is an index
    error (a device-side assert on CUDA), never a silent result."""
    _check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, gate_up_bias, down_bias,
           bool(transposed), alpha, limit)
    device_type = hidden.device.type
    out_dtype = hidden.dtype
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, gate_up_proj, down_proj = hidden.to(dtype), gate_up_proj.to(dtype), down_proj.to(dtype)
        gate_up_bias = gate_up_bias.to(dtype) if gate_up_bias is not None else None
        down_bias = down_bias.to(dtype) if down_bias is not None else None
    dtypes = {t.dtype for t in (hidden, gate_up_proj, down_proj, gate_up_bias, down_bias) if t is not None}
    if len(dtypes) != 1:
        raise ValueError(f"moe_experts: hidden, gate_up_proj, down_proj (and the biases) must share a dtype outside "
                         f"autocast; got {', '.join(sorted(str(d) for d in dtypes))}")
    if recompute_h is None:
        recompute_h = TUNING["recompute_h"]
    with torch.autocast(device_type, enabled=False):
        return _MoEExperts.apply(hidden.contiguous(), top_k_index, top_k_weights.contiguous(),
                                 gate_up_proj, down_proj, activation, out_dtype, bool(recompute_h),
                                 gate_up_bias, down_bias, bool(interleaved), bool(transposed),
                                 None if alpha is None else float(alpha), None if limit is None else float(limit))
