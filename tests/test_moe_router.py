"""foak.ops.moe_router.moe_route in the Triton interpreter against transformers' routing written in fp64 torch
(softmax, top-k, renormalisation): weights, indices and the logits' gradient; E not a power of two, k = 1,
k = E, rows past a block, bf16 logits; the errors."""

import pytest
import torch

from foak.ops import moe_router as router_mod
from foak.ops.moe_router import moe_route


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setitem(router_mod.TUNING, "block_t", 16)  # 37 rows: 3 programs, the last one partial


def fp64_route(logits, k, renormalize):
    p = torch.softmax(logits.double(), dim=-1)
    w, i = torch.topk(p, k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, i


@pytest.mark.parametrize("E,k", [(8, 2), (6, 3), (8, 1), (5, 5), (128, 8)])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_fp64_routing(E, k, renormalize, dtype):
    # distinct values in every row (exact in bf16), so that the top-k choice has no ties
    distinct = torch.argsort(torch.rand(37, E), dim=-1).float()
    logits = ((distinct - E / 2) * 0.5 + torch.rand(37, 1)).to(dtype).requires_grad_()
    w, idx = moe_route(logits, k, renormalize)
    ref_logits = logits.detach().double().requires_grad_()
    ref_w, ref_idx = fp64_route(ref_logits, k, renormalize)
    assert w.dtype == torch.float32 and idx.dtype == torch.int64 and w.shape == (37, k)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-6, atol=1e-7)
    g = torch.randn(37, k)
    (dz,) = torch.autograd.grad(w, logits, g)
    (ref_dz,) = torch.autograd.grad(ref_w, ref_logits, g.double())
    assert dz.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(dz.double(), ref_dz, rtol=tol, atol=tol)


def test_ties_go_to_the_lower_index_and_errors():
    logits = torch.zeros(3, 4)
    w, idx = moe_route(logits, 2)
    assert idx.tolist() == [[0, 1]] * 3 and torch.equal(w, torch.full((3, 2), 0.5))
    with pytest.raises(ValueError, match="k must be an int in 1..4"):
        moe_route(logits, 5)
    with pytest.raises(ValueError, match="2-D"):
        moe_route(logits[None], 2)
