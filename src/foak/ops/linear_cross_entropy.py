"""Linear layer + cross-entropy (the LM head and its loss) without materialising the [N, V] logits.

``linear_cross_entropy(hidden, weight, target, bias=None, shift=False, **loss_options)`` equals
``cross_entropy(hidden @ weight.T + bias, target, **loss_options)`` (see ``ops/cross_entropy.py`` for the
options). Rows are processed in chunks sized to a fixed memory budget; rows whose target is ignored are
skipped entirely (no GEMM work). ``shift=True`` takes hidden ``[B, S, H]`` and unshifted labels
``[B, S]`` and predicts token ``s + 1`` from position ``s`` by shifting the labels, never the hidden states.
"""

from __future__ import annotations

import torch

from foak.ops.cross_entropy import cross_entropy_reference


# 1. reference -------------------------------------------------------------------------------------
def shift_labels(target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """[B, S] labels -> labels for "position s predicts token s + 1" (last position ignored)."""
    return torch.nn.functional.pad(target[..., 1:], (0, 1), value=ignore_index)


def linear_cross_entropy_reference(hidden, weight, target, bias=None, shift=False, ignore_index=-100, **loss_options):
    """Materialises the logits in fp32 (ground truth for tests)."""
    if shift:
        target = shift_labels(target, ignore_index)
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    return cross_entropy_reference(logits, target.reshape(-1), ignore_index=ignore_index, **loss_options)
