"""A per-token block computed in sequence chunks, in the forward and in the backward.

``tiled(fn, x, params, chunk_tokens)`` equals ``fn(x)`` for a function that acts on each token (row of the
flattened ``x``) independently, e.g. a gated MLP ``down(act(gate(x)) * up(x))``, but never holds the block's
inner tensors ([tokens, intermediate]) for more than ``chunk_tokens`` tokens at a time:

* forward: ``fn`` runs chunk by chunk without grad; only ``x`` is saved (and the output is returned);
* backward: each chunk is recomputed with grad enabled and differentiated at once
  (``torch.autograd.grad``): ``dx`` is written chunk by chunk, the gradients of ``params`` are summed over the
  chunks and returned as this op's gradients, so they reach the parameters through the ordinary graph (each
  parameter's AccumulateGrad runs once per backward, as without tiling: DDP's gradient hooks see them as
  usual).

``params`` must hold every tensor that requires grad that ``fn`` reads besides ``x`` (the trainable
parameters); the backward raises if ``fn`` reads one it was not given. The autocast state and the RNG state
(dropout inside ``fn``) of the forward are restored for the recompute. Cost: one more forward of ``fn`` (the
recompute) per backward, except under non-reentrant checkpointing when x is the last tensor the checkpointed
region saves (a Llama-like layer's MLP): the forward saves x after computing only the first chunk, so the
checkpoint's recompute stops there (early stop) and the backward's recompute replaces the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["tiled"]


def _chunks(n: int, size: int):
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _run_chunks(fn, flat: torch.Tensor, size: int) -> torch.Tensor:
    out = None
    for s, e in _chunks(flat.shape[0], size):
        y = fn(flat[s:e])
        if out is None:
            out = y.new_empty((flat.shape[0], *y.shape[1:]))
        out[s:e] = y
        del y
    return out


def _autocast_state(device_type: str):
    if device_type not in ("cuda", "cpu", "xpu", "mps") or not torch.is_autocast_enabled(device_type):
        return None
    return device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled()


def _leaves(y: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors that ``y``'s graph accumulates gradients into."""
    seen, stack, leaves = set(), [y.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(n for n, _ in node.next_functions)
    return leaves


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, size, x, *params):
        ctx.fn, ctx.size = fn, size
        ctx.autocast = _autocast_state(x.device.type)
        ctx.rng = torch.get_rng_state()
        ctx.device_rng = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
        ctx.save_for_backward(x)
        # (the parameters themselves, not saved copies: the recompute must differentiate the very tensors the
        # block reads, and a saved leaf unpacks as another Python object)
        ctx.params = params
        # only the first chunk here (for the output's shape and dtype); :func:`tiled` fills in the others after
        # this returns, i.e. after autograd saved x: non-reentrant checkpointing's recompute stops at that save
        # when it is the layer's last (early stop), so a recompute does not run the whole block for nothing
        flat = x.reshape(-1, x.shape[-1])
        y = fn(flat[:size])
        out = y.new_empty((*x.shape[:-1], y.shape[-1]))
        out.view(-1, y.shape[-1])[: y.shape[0]] = y
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        params = ctx.params
        flat = x.reshape(-1, x.shape[-1])
        g_flat = grad_out.reshape(-1, grad_out.shape[-1])
        want_x = ctx.needs_input_grad[2]
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[3:]) if need]
        dx = torch.empty_like(flat) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        devices = [x.device] if ctx.device_rng is not None else []
        checked = False
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.rng)
            if ctx.device_rng is not None:
                torch.cuda.set_rng_state(ctx.device_rng, x.device)
            for s, e in _chunks(flat.shape[0], ctx.size):
                xc = flat[s:e].detach().requires_grad_(want_x)
                with torch.enable_grad():
                    if ctx.autocast is not None:
                        device_type, dtype, cache = ctx.autocast
                        with torch.autocast(device_type, dtype=dtype, cache_enabled=cache):
                            y = ctx.fn(xc)
                    else:
                        y = ctx.fn(xc)
                if not checked and y.grad_fn is not None:
                    known = {id(t) for t in (xc, *params)}
                    stray = [t for t in _leaves(y) if t.requires_grad and id(t) not in known]
                    if stray:
                        raise RuntimeError(
                            f"foak tiled: the recomputed block read {len(stray)} tensor(s) requiring grad that it "
                            f"was not given (shapes {[tuple(t.shape) for t in stray[:3]]}); their gradients would be "
                            "lost. A wrapper (FSDP?) replaced the module's parameters between the forward and the "
                            "backward: turn tiled_mlp off under it")
                    checked = True
                inputs = ([xc] if want_x else []) + wanted
                if y.grad_fn is None:  # nothing in this chunk depends on what needs a gradient
                    grads = [None] * len(inputs)
                else:
                    grads = torch.autograd.grad(y, inputs, g_flat[s:e], allow_unused=True)
                del y
                if want_x:
                    gx, grads = grads[0], grads[1:]
                    if gx is None:
                        dx[s:e].zero_()
                    else:
                        dx[s:e] = gx
                for i, g in enumerate(grads):
                    if g is not None:
                        sums[i] = g if sums[i] is None else sums[i].add_(g)
        it = iter(sums)
        out_params = [next(it) if need else None for need in ctx.needs_input_grad[3:]]
        return (None, None, dx.view(x.shape) if want_x else None, *out_params)


def tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor],
          chunk_tokens: int) -> torch.Tensor:
    """``fn(x)`` computed over the tokens of ``x`` (all dims but the last, flattened) in chunks of
    ``chunk_tokens`` in the forward and in the backward (see the module doc). ``fn`` receives 2-D chunks
    ``[n, hidden]`` and must return ``[n, out]``."""
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens <= 0:
        raise ValueError(f"tiled: chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    if x.dim() < 1:
        raise ValueError("tiled: x must have at least one dimension (the features)")
    params = [p for p in params if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        flat = x.reshape(-1, x.shape[-1])
        out = _run_chunks(fn, flat, chunk_tokens)
        return out.view(*x.shape[:-1], out.shape[-1])
    out = _Tiled.apply(fn, chunk_tokens, x, *params)
    flat, out_flat = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    with torch.no_grad():  # the other chunks (see _Tiled.forward), into the graph's output
        for s, e in _chunks(flat.shape[0], chunk_tokens)[1:]:
            y = fn(flat[s:e])
            if y.shape != (e - s, out_flat.shape[1]):
                raise ValueError(f"tiled: fn returned {tuple(y.shape)} for a chunk of {e - s} tokens; it must return "
                                 f"[tokens, {out_flat.shape[1]}] (a per-token block)")
            out_flat[s:e] = y
    return out
