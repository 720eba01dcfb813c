"""Saving an autograd Function's tensors before its forward's work, so a checkpoint's recompute can stop earlier.

Under non-reentrant activation checkpointing (HF's default, TRL's), the backward recomputes a layer's forward
only until every tensor the layer saved has been saved again, then stops (torch's early stop). An aten op saves
its inputs before it runs, so when a layer's last saved tensors are the inputs of its last GEMM (a gated MLP's
down projection), the recompute stops before that GEMM. A custom ``autograd.Function`` saves its tensors only
after its forward returns, so its GEMM would run in the recompute and be thrown away (one MLP-sized GEMM per
layer and step).

:func:`save_first` saves the tensors in a separate node ahead of the Function: the Function takes the returned
token as an input, reads the tensors with :func:`saved` in its backward and returns :func:`token_grad` for the
token, so the saving node runs right after it and releases them. Under ``torch.compile`` callers keep saving in
their own Function (the compiler plans recomputation itself).
"""

from __future__ import annotations

import torch


class Saver:
    """Hands the saving node's context to the consuming node (a non-tensor argument of both)."""

    __slots__ = ("ctx",)

    def __init__(self):
        self.ctx = None


class _SaveFirst(torch.autograd.Function):
    @staticmethod
    def forward(ctx, saver, *tensors):
        ctx.save_for_backward(*tensors)
        ctx.count = len(tensors)
        saver.ctx = ctx
        return tensors[0].new_empty(0)  # the token: links this node to the consumer's

    @staticmethod
    def backward(ctx, _token_grad):
        return (None,) * (1 + ctx.count)


def save_first(*tensors: torch.Tensor) -> tuple[torch.Tensor, Saver]:
    """Saves ``tensors`` for a backward now; returns the token to pass to the consuming Function and the saver
    to hand it (a non-tensor argument)."""
    saver = Saver()
    token = _SaveFirst.apply(saver, *tensors)
    return token, saver


def saved(saver: Saver) -> tuple[torch.Tensor, ...]:
    """The tensors the saving node saved (unpacked: a checkpoint recomputes its region here). The saving node
    releases them when it runs, right after the consumer (also with retain_graph, for a second backward)."""
    return saver.ctx.saved_tensors


def token_grad(token: tuple[torch.dtype, torch.device]) -> torch.Tensor:
    """The gradient the consumer returns for the token (its (dtype, device), kept by the consumer's forward): empty,
    so the saving node runs and frees its tensors."""
    dtype, device = token
    return torch.zeros(0, dtype=dtype, device=device)
