"""When an op's backward may write gradients into the memory of its saved inputs.

Reusing an input's memory for its gradient saves one activation-sized allocation per op. It is safe
only for autograd intermediates nobody else will read: not leaves (the caller's tensors, parameters),
not views (they may alias a leaf, and autograd forbids writing into multi-output views), each in its own
contiguous memory. The ops bump the version counter of such inputs in the forward, so an op that saved
one of them earlier fails loudly in its backward instead of reading overwritten values, and again in the
backward once they are overwritten, so a second backward through a retained graph fails loudly too.
"""

from __future__ import annotations

import torch


def can_overwrite(*tensors: torch.Tensor) -> bool:
    """True when the backward may reuse the memory of every one of ``tensors``."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False  # the compiler plans memory itself; grad_fn cannot be inspected while tracing
    storages = set()
    for t in tensors:
        if t.grad_fn is None or t._is_view() or not t.is_contiguous():
            return False
        storages.add(t.untyped_storage().data_ptr())
    return len(storages) == len(tensors)  # e.g. swiglu(x, x) needs separate gradient memory


def claim(*tensors: torch.Tensor) -> None:
    """Mark tensors as to-be-overwritten: earlier saved uses of them now fail loudly in backward."""
    for t in tensors:
        torch.autograd.graph.increment_version(t)


def overwritten(*tensors: torch.Tensor) -> None:
    """Mark saved tensors a backward has just overwritten with gradients: a second backward through a retained
    graph (``retain_graph=True``) then fails with autograd's in-place error instead of reading gradients."""
    for t in tensors:
        torch.autograd.graph.increment_version(t)
