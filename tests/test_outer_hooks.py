"""Outer saved-tensor hooks (torch.autograd.graph.save_on_cpu, TRL's activation offloading) and foak's
RMSNorm-output recompute scope (foak.ops._recompute).

The scope works through ``saved_tensors_hooks`` of its own; hooks are a stack and only the innermost one
sees a saved tensor, so under an outer hook foak must step aside: the outer hook then sees every tensor
autograd saves in the patched model. The reference for "every tensor" is the same patched model with
the recompute scope replaced by a no-op (no foak hook at all): foak's kernels save other tensors than
HF's ops, so the unpatched model's count is not the right reference.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import foak
from foak.models.tiny import tiny_model
from foak.models import rules_for
from foak.ops import _recompute
from foak.ops._recompute import recomputing_outputs
from foak.patching import apply

# every switch but RoPE, whose kernel takes half of a step's time in the interpreter and has nothing to do with
# the recompute scope (the RMSNorm outputs that q, k, v, gate and up save)
SWITCHES = dict(fast_rms_layernorm=True, fast_swiglu=True, fused_linear_loss=True)
ENABLED = {"rms_norm", "swiglu", "fused_linear_loss"}


def _model(checkpointing=False):
    model = tiny_model("llama")
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class CountingHooks(torch.autograd.graph.saved_tensors_hooks):
    """Records (shape, dtype) of every tensor it packs; unpacks it unchanged."""

    def __init__(self):
        self.packed = []

        def pack(t):
            self.packed.append((tuple(t.shape), t.dtype))
            return t

        super().__init__(pack, lambda t: t)


def _step(model, ids, context=contextlib.nullcontext):
    with context():
        loss = model(input_ids=ids, labels=ids).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.detach(), grads


@pytest.fixture
def ids():
    return torch.randint(0, 301, (2, 9))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_an_outer_hook_sees_every_tensor_the_patched_model_saves(ids, checkpointing):
    model = _model(checkpointing)
    foak.patch(model, **SWITCHES)
    outer = CountingHooks()
    loss, grads = _step(model, ids, lambda: outer)

    # reference: the same model patched with the same rules but the recompute scope (no foak hook at all)
    plain = _model(checkpointing)
    apply(plain, [r for r in rules_for(plain) if r.switch in ENABLED and not r.id.endswith("_recompute")], "llama")
    only = CountingHooks()
    loss_only, _ = _step(plain, ids, lambda: only)
    # the model saves a lot (checkpointing: the layer inputs and what lies outside the layers), so
    # equality is no accident
    assert len(only.packed) > (5 if checkpointing else 40)
    assert sorted(outer.packed, key=str) == sorted(only.packed, key=str)

    # and the backward is unchanged by the outer hook (the recompute is bit-identical to keeping y)
    loss_ref, grads_ref = _step(model, ids)
    assert torch.equal(loss, loss_ref) and torch.equal(loss_only, loss_ref)
    for g, r in zip(grads, grads_ref):
        assert torch.equal(g, r)


def test_save_on_cpu_gives_the_gradients_of_the_unhooked_run(ids):
    model = _model()
    foak.patch(model, **SWITCHES)
    ref = _model()
    loss, grads = _step(model, ids, lambda: torch.autograd.graph.save_on_cpu(pin_memory=False))
    loss_plain, grads_plain = _step(model, ids)
    loss_hf, grads_hf = _step(ref, ids)
    assert torch.equal(loss, loss_plain)
    for g, p in zip(grads, grads_plain):
        assert torch.equal(g, p)
    assert torch.allclose(loss, loss_hf, rtol=1e-5, atol=0)
    for g, h in zip(grads, grads_hf):
        assert torch.allclose(g, h, rtol=1e-4, atol=1e-6)


def test_without_an_outer_hook_the_recompute_still_runs(ids, monkeypatch):
    handles = []
    init = _recompute._Saved.__init__
    monkeypatch.setattr(_recompute._Saved, "__init__", lambda self, *a: (handles.append(1), init(self, *a))[1])
    model = _model()
    row = foak.patch(model, **SWITCHES).result("llama.rms_norm_recompute")
    _step(model, ids)
    assert len(handles) == 5 * model.config.num_hidden_layers  # q, k, v, gate, up save recipes
    assert row.notes == ""
    handles.clear()
    _step(model, ids, CountingHooks)
    assert handles == []  # stepped aside
    assert row.notes == ("recompute stepped aside in 1 of 2 forwards (an outer saved-tensor hook was active: "
                         "test_outer_hooks.CountingHooks.__init__.<locals>.pack)")
    _step(model, ids)
    assert len(handles) == 5 * model.config.num_hidden_layers
    assert row.notes.startswith("recompute stepped aside in 1 of 3 forwards")


def test_saved_tensor_hooks_disabled_outside_steps_aside(ids):
    # torch.autograd.graph.disable_saved_tensors_hooks forbids pushing hooks: the scope must not try
    model = _model()
    foak.patch(model, **SWITCHES)
    loss_ref, grads_ref = _step(model, ids)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in here"):
        loss, grads = _step(model, ids)
    assert torch.equal(loss, loss_ref)
    for g, r in zip(grads, grads_ref):
        assert torch.equal(g, r)


# ---- the detection itself ----------------------------------------------------------------------------


def test_outer_hook_detection():
    outer_hooks_reason = _recompute.outer_hooks_reason
    assert outer_hooks_reason() is None
    with CountingHooks():
        assert "an outer saved-tensor hook was active" in outer_hooks_reason()
    with torch.autograd.graph.save_on_cpu():
        assert "an outer saved-tensor hook was active" in outer_hooks_reason()
    with torch.autograd.graph.disable_saved_tensors_hooks("off"):
        assert "disabled" in outer_hooks_reason()
    assert outer_hooks_reason() is None
    with recomputing_outputs() as scope:  # our own hooks are not "outer" to a nested scope
        assert scope.active and scope.stepped_aside is None
        with recomputing_outputs() as nested:
            assert not nested.active and nested.stepped_aside is None
    with CountingHooks(), recomputing_outputs() as scope:
        assert not scope.active and "outer saved-tensor hook" in scope.stepped_aside


def test_detection_without_the_private_accessor(monkeypatch):
    # a torch without torch._C._autograd._top_saved_tensors_default_hooks (or with another signature):
    # the scope cannot tell, so it steps aside and says why
    outer_hooks_reason = _recompute.outer_hooks_reason
    monkeypatch.setattr(_recompute, "_top_hooks_accessor", lambda: None)
    assert "cannot tell" in outer_hooks_reason()
    with recomputing_outputs() as scope:
        assert not scope.active and "cannot tell" in scope.stepped_aside

    top = torch._C._autograd._top_saved_tensors_default_hooks
    monkeypatch.setattr(_recompute, "_top_hooks_accessor", lambda: (lambda: top(True)))  # no-argument form
    assert outer_hooks_reason() is None
    with CountingHooks():
        assert "outer saved-tensor hook was active" in outer_hooks_reason()

    def broken(*args):
        raise RuntimeError("changed")

    monkeypatch.setattr(_recompute, "_top_hooks_accessor", lambda: broken)
    assert "cannot tell" in outer_hooks_reason()


def test_the_accessor_exists_on_this_torch():
    # the fallback above must stay a fallback: on the torch foak is tested with, detection is real
    assert _recompute._top_hooks_accessor() is not None
    assert _recompute._top_hooks_accessor()(True) is None
