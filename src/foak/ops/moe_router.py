"""MoE routing: softmax over the router logits, top-k, optional renormalisation, forward and backward, in one
Triton kernel each way.

``moe_route(logits [T, E], k, renormalize)`` returns ``(weights [T, k] fp32, indices [T, k] int64)`` as
transformers' Mixtral / Qwen3-MoE routers compute them: ``p = softmax(float(logits))``, the k largest
``p`` in descending order, divided by their sum when ``renormalize``. (GraniteMoE's "top-k of the logits,
then softmax over those k" is the same function with ``renormalize=True``.) The kernel never writes ``p``:
with ``m`` the row maximum, a chosen expert's weight is ``exp(z - m) / sum_top exp(z_l - m)`` (renormalised)
or ``exp(z - m) / sum_all exp(z - m)`` — the same values up to fp32 rounding. Ties between equal logits go
to the lower expert index.

Measured on the H200 (benchmarks/moe.py --router, results/moe_h200_router.json; the Mixtral-small step in
results/train_step_h200_mixtral-small_moe_router.json), this does not pay: router fwd+bwd 0.83 ms vs
transformers' 0.87 at T=8192 E=8 k=2 (0.91 vs 1.03 at T=16384 E=128 k=8), both bound by launching small
kernels, and the training step did not get faster (102.9k tokens/s with it, 105.8k without, one run each).
So no rule uses it: foak.patch leaves transformers' routers as they are; the op is here for callers who
route themselves.

The backward gives the logits' gradient for the weights' gradient ``g``: renormalised,
``dz[i_j] = w_j (g_j - sum_l w_l g_l)`` at the chosen experts and 0 elsewhere; otherwise
``dz = p * (G - sum_j p[i_j] g_j)`` with ``G`` = ``g`` scattered to the chosen experts (``p`` recomputed
from the saved logits). The indices are not differentiable. The logits keep their own gradient path for
the auxiliary load-balancing loss, which stays transformers' (it reads the logits, not these weights).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foak.backend import use_triton
from foak.ops._checks import check_not_sharded
from foak.ops._custom_op import custom_op

TUNING = {"block_t": 32, "warps": 4}


# 1. reference -------------------------------------------------------------------------------------
def moe_route_reference(logits: torch.Tensor, k: int, renormalize: bool = True):
    """transformers' routing in torch: fp32 softmax, top-k, optional renormalisation."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, indices = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices


# 2. kernels ---------------------------------------------------------------------------------------
@triton.jit
def _route_forward_kernel(LOGITS, stride, W, IDX, T, E, K: tl.constexpr, E_POW2: tl.constexpr,
                          K_POW2: tl.constexpr, BLOCK_T: tl.constexpr, RENORM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_POW2)
    slots = tl.arange(0, K_POW2)
    row_ok = rows < T
    z = tl.load(LOGITS + rows.to(tl.int64)[:, None] * stride + cols[None, :],
                mask=row_ok[:, None] & (cols < E)[None, :], other=-float("inf")).to(tl.float32)
    z = tl.where(row_ok[:, None], z, 0.0)  # rows past T: finite values, never stored
    z = tl.where((cols < E)[None, :], z, -float("inf"))
    zmax = tl.max(z, axis=1)
    top = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    chosen = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int64)
    work = z
    for j in tl.static_range(K):
        best = tl.argmax(work, axis=1)  # the lowest index among equal maxima
        value = tl.max(work, axis=1)
        top = tl.where(slots[None, :] == j, tl.exp(value - zmax)[:, None], top)
        chosen = tl.where(slots[None, :] == j, best.to(tl.int64)[:, None], chosen)
        work = tl.where(cols[None, :] == best[:, None], -float("inf"), work)
    if RENORM:
        denom = tl.sum(top, axis=1)
    else:
        denom = tl.sum(tl.exp(z - zmax[:, None]), axis=1)
    out_ok = row_ok[:, None] & (slots < K)[None, :]
    offs = rows.to(tl.int64)[:, None] * K + slots[None, :]
    tl.store(W + offs, top / denom[:, None], mask=out_ok)
    tl.store(IDX + offs, chosen, mask=out_ok)


@triton.jit
def _route_backward_kernel(LOGITS, stride, W, IDX, DW, DLOGITS, T, E, K: tl.constexpr, E_POW2: tl.constexpr,
                           K_POW2: tl.constexpr, BLOCK_T: tl.constexpr, RENORM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_POW2)
    slots = tl.arange(0, K_POW2)
    row_ok = rows < T
    out_ok = row_ok[:, None] & (slots < K)[None, :]
    offs = rows.to(tl.int64)[:, None] * K + slots[None, :]
    w = tl.load(W + offs, mask=out_ok, other=0.0)
    g = tl.load(DW + offs, mask=out_ok, other=0.0).to(tl.float32)
    idx = tl.load(IDX + offs, mask=out_ok, other=-1)
    col_ok = (cols < E)[None, :]
    if RENORM:
        dsel = w * (g - tl.sum(w * g, axis=1)[:, None])
        dz = tl.zeros((BLOCK_T, E_POW2), dtype=tl.float32)
        for j in tl.static_range(K):
            idx_j = tl.sum(tl.where(slots[None, :] == j, idx, 0), axis=1)
            d_j = tl.sum(tl.where(slots[None, :] == j, dsel, 0.0), axis=1)
            dz = tl.where(cols[None, :] == idx_j[:, None], d_j[:, None], dz)
    else:
        z = tl.load(LOGITS + rows.to(tl.int64)[:, None] * stride + cols[None, :],
                    mask=row_ok[:, None] & col_ok, other=-float("inf")).to(tl.float32)
        z = tl.where(row_ok[:, None], z, 0.0)
        z = tl.where(col_ok, z, -float("inf"))
        e = tl.exp(z - tl.max(z, axis=1)[:, None])
        p = e / tl.sum(e, axis=1)[:, None]
        scattered = tl.zeros((BLOCK_T, E_POW2), dtype=tl.float32)
        for j in tl.static_range(K):
            idx_j = tl.sum(tl.where(slots[None, :] == j, idx, 0), axis=1)
            g_j = tl.sum(tl.where(slots[None, :] == j, g, 0.0), axis=1)
            scattered = tl.where(cols[None, :] == idx_j[:, None], g_j[:, None], scattered)
        dz = p * (scattered - tl.sum(p * scattered, axis=1)[:, None])
    tl.store(DLOGITS + rows.to(tl.int64)[:, None] * E + cols[None, :], dz.to(DLOGITS.dtype.element_ty),
             mask=row_ok[:, None] & col_ok)


# 3. launchers / custom ops ------------------------------------------------------------------------
def _grid(T):
    return (triton.cdiv(T, TUNING["block_t"]),)


def _forward_fake(logits, k, renormalize):
    T = logits.shape[0]
    return (logits.new_empty((T, k), dtype=torch.float32), logits.new_empty((T, k), dtype=torch.int64))


@custom_op("moe_route_forward", _forward_fake)
def _forward_op(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = logits.shape
    w = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    idx = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    if T:
        _route_forward_kernel[_grid(T)](
            logits, logits.stride(0), w, idx, T, E, K=k, E_POW2=triton.next_power_of_2(E),
            K_POW2=triton.next_power_of_2(k), BLOCK_T=TUNING["block_t"], RENORM=renormalize,
            num_warps=TUNING["warps"])
    return w, idx


def _backward_fake(logits, w, idx, dw, renormalize):
    return logits.new_empty(logits.shape)


@custom_op("moe_route_backward", _backward_fake)
def _backward_op(logits: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, dw: torch.Tensor,
                 renormalize: bool) -> torch.Tensor:
    T, E = logits.shape
    dlogits = torch.empty((T, E), dtype=logits.dtype, device=logits.device)
    if T:
        k = w.shape[1]
        _route_backward_kernel[_grid(T)](
            logits, logits.stride(0), w, idx, dw.contiguous(), dlogits, T, E, K=k,
            E_POW2=triton.next_power_of_2(E), K_POW2=triton.next_power_of_2(k), BLOCK_T=TUNING["block_t"],
            RENORM=renormalize, num_warps=TUNING["warps"])
    return dlogits


class _MoERoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, renormalize):
        w, idx = _forward_op(logits, k, renormalize)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(logits, w, idx)
        ctx.renormalize = renormalize
        return w, idx

    @staticmethod
    def backward(ctx, dw, _didx):
        logits, w, idx = ctx.saved_tensors
        if dw is None:
            return None, None, None
        return _backward_op(logits, w, idx, dw, ctx.renormalize), None, None


# 4. public function -------------------------------------------------------------------------------
def moe_route(logits: torch.Tensor, k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``logits`` ``[T, E]`` (fp32, bf16 or fp16): ``(weights [T, k] fp32, indices
    [T, k] int64)``, weights differentiable (the gradient reaches ``logits`` in its dtype). See the module
    docstring for the math; ``renormalize`` divides the k weights by their sum (Mixtral; Qwen3-MoE's
    ``norm_topk_prob``)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype not in (
            torch.float32, torch.bfloat16, torch.float16):
        raise ValueError("moe_route: logits must be a 2-D fp32/bf16/fp16 tensor [tokens, experts], got "
                         + (f"{logits.dtype} {tuple(logits.shape)}" if isinstance(logits, torch.Tensor)
                            else type(logits).__name__))
    check_not_sharded("moe_route", "logits", logits)
    E = logits.shape[1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= E:
        raise ValueError(f"moe_route: k must be an int in 1..{E} (the number of experts), got {k!r}")
    if not use_triton(logits.device):
        return moe_route_reference(logits, k, renormalize)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _MoERoute.apply(logits, k, bool(renormalize))
