"""foak.ops._recompute: RMSNorm outputs saved by their consumers as recipes, recomputed in the backward."""

import contextlib
import gc

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from foak.ops import _recompute
from foak.ops.rms_norm import rms_norm
from foak.ops._recompute import recomputing_outputs


@pytest.fixture(autouse=True)
def _seed(request):
    """conftest's _seed, with its full garbage collection (~0.2 s) only before the tests that compile (the
    finalizers of other tests' patched models must not run inside a trace)."""
    if "compile" in request.node.originalname:
        gc.collect()
    torch.manual_seed(1234)


@pytest.fixture
def recomputes(monkeypatch):
    """Counts recomputations and saved handles."""
    counts = {"recomputed": 0, "handles": 0}
    value, init = _recompute._Recipe.value, _recompute._Saved.__init__

    def counted_value(self):
        if self.cache is None:
            counts["recomputed"] += 1
        return value(self)

    def counted_init(self, *args):
        counts["handles"] += 1
        init(self, *args)

    monkeypatch.setattr(_recompute._Recipe, "value", counted_value)
    monkeypatch.setattr(_recompute._Saved, "__init__", counted_init)
    return counts


def _block(x0, w, wq, wk, dtype, modify=None):
    x = x0.to(dtype) * 1.0
    y = rms_norm(x, w.to(dtype), 1e-6, inplace_backward=False)
    q = torch.nn.functional.linear(y, wq.to(dtype))  # saves a [tokens, hidden] view of y
    k = y @ wk.to(dtype).t()  # saves y itself
    if modify == "after_save":
        y.mul_(2)
    return (q.float().sin().sum() + k.float().cos().sum()), x


def _leaves():
    return (torch.randn(3, 5, 33, requires_grad=True), torch.randn(33, requires_grad=True),
            torch.randn(7, 33, requires_grad=True), torch.randn(4, 33, requires_grad=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputed_backward_is_bit_identical_and_recomputes_once(dtype, recomputes):
    leaves = _leaves()
    loss, _ = _block(*leaves, dtype)
    grads = torch.autograd.grad(loss, leaves)
    with recomputing_outputs():
        loss_r, _ = _block(*leaves, dtype)
    assert recomputes == {"recomputed": 0, "handles": 2}  # both consumers saved a handle, not y
    grads_r = torch.autograd.grad(loss_r, leaves)
    assert recomputes["recomputed"] == 1  # shared by the two consumers
    assert torch.equal(loss, loss_r)
    for g, gr in zip(grads, grads_r):
        assert torch.equal(g, gr)


def test_outside_the_scope_nothing_changes(recomputes):
    leaves = _leaves()
    torch.autograd.grad(_block(*leaves, torch.float32)[0], leaves)
    assert recomputes == {"recomputed": 0, "handles": 0}


def test_checkpointed_regions_keep_their_own_hooks(recomputes):
    leaves = _leaves()
    grads = torch.autograd.grad(_block(*leaves, torch.float32)[0], leaves)
    with recomputing_outputs():
        loss = checkpoint(lambda *t: _block(*t, torch.float32)[0], *leaves, use_reentrant=False)
    grads_c = torch.autograd.grad(loss, leaves)
    assert recomputes["handles"] == 0  # checkpoint's hooks took precedence inside its region
    for g, gc in zip(grads, grads_c):
        assert torch.allclose(g, gc, rtol=1e-6, atol=1e-6)


def test_an_output_nobody_saved_keeps_no_input_alive(recomputes):
    """Inside the scope, an offered output's recipe holds its inputs only once a consumer saved the output
    as it: otherwise (e.g. a layer under activation checkpointing, whose hooks take the saved tensors) the
    input dies when the program drops it, as it would without the scope."""
    import weakref

    from memory_utils import interpreter_launches_without_cycles  # (the interpreter's own cycles keep x)

    x0, w, wq, _ = _leaves()
    with interpreter_launches_without_cycles(), recomputing_outputs():
        freed = []
        x = x0 * 1.0
        weakref.finalize(x.untyped_storage(), freed.append, "x")
        y = rms_norm(x, w, 1e-6, inplace_backward=False)
        with torch.no_grad():  # a consumer that saves nothing
            y @ wq.t()
        del x, y
        assert freed == ["x"]
        # the Python object of the input dropped, the output saved by a consumer: still a recipe (autograd's
        # own saved copy of x keeps it alive)
        x = x0 * 1.0
        y = rms_norm(x, w, 1e-6, inplace_backward=False)
        del x
        loss = (y @ wq.t()).sum()
    assert recomputes["handles"] == 1
    del y
    loss.backward()
    assert recomputes["recomputed"] == 1


def test_the_output_cannot_be_modified_in_place():
    # so a recipe cannot go stale: autograd refuses in-place changes of rms_norm's output (a custom
    # Function's view output), with or without the scope
    leaves = _leaves()
    with pytest.raises(RuntimeError, match="is being modified inplace"):
        with recomputing_outputs():
            _block(*leaves, torch.float32, modify="after_save")


def test_input_modified_in_place_before_the_backward_is_an_error():
    leaves = _leaves()
    with recomputing_outputs():
        loss, x = _block(*leaves, torch.float32)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place between the forward and the backward"):
        loss.backward()


def test_compiled_code_inside_the_scope_is_unaffected(recomputes):
    leaves = _leaves()
    compiled = torch.compile(lambda *t: _block(*t, torch.float32)[0], backend="aot_eager", fullgraph=True)
    with recomputing_outputs():
        loss = compiled(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    ref = torch.autograd.grad(_block(*leaves, torch.float32)[0], leaves)
    for g, r in zip(grads, ref):
        assert torch.allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_patched_llama_recomputes_its_norm_outputs(recomputes, checkpointing):
    import foak
    from foak.models.tiny import tiny_model

    model = tiny_model("llama")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    foak.patch(model, fast_rms_layernorm=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    layers = model.config.num_hidden_layers
    if checkpointing:  # the checkpointed layers save nothing; only their inputs are kept
        assert recomputes == {"recomputed": 0, "handles": 0}
    else:  # per layer: the input norm's output saved by q, k, v; the post-attention norm's by gate, up
        assert recomputes == {"recomputed": 2 * layers, "handles": 5 * layers}


@pytest.mark.parametrize("what", ["whole model", "each layer"])
def test_a_compiled_patched_llama_matches_the_unpatched_one(what):
    import foak
    from foak.models.tiny import tiny_model
    from foak.testing import relative_error

    model, ref = tiny_model("llama"), tiny_model("llama")
    model.train(), ref.train()
    foak.patch(model, fast_rms_layernorm=True, fast_swiglu=True)
    if what == "whole model":
        run = torch.compile(model, backend="aot_eager")
    else:
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")  # compiled regions inside the (eager) recompute scope
        run = model
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert relative_error(loss, ref_loss) < 1e-6
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert relative_error(p.grad, r.grad) < 1e-5, name


def test_a_tensor_saved_through_the_scope_and_modified_in_place_fails_in_the_backward():
    # autograd skips its own version check for tensors saved through hooks; the scope's unpack makes it
    x = torch.randn(4, 6, requires_grad=True)
    with recomputing_outputs():
        y = x * 2
        z = (y * y).sum()  # saves y
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_second_backward_through_a_patched_gated_mlp_is_refused_not_wrong():
    # the gated MLP's in-place backward overwrites g and u; a second backward through the retained graph must fail
    # (it computed gradients 50% off before); without fast_swiglu it runs and doubles the gradients
    import foak
    from foak.models.tiny import tiny_model

    ids = torch.randint(0, 301, (2, 16), generator=torch.Generator().manual_seed(0))
    for switches, refused in (({"fast_rms_layernorm": True, "fast_swiglu": True}, True),
                              ({"fast_rms_layernorm": True, "fast_rope_embeddings": True}, False)):
        model = tiny_model("llama")
        foak.patch(model, **switches)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(retain_graph=True)
        first = {n: p.grad.clone() for n, p in model.named_parameters()}
        if refused:
            with pytest.raises(RuntimeError, match="patch without fast_swiglu"):
                loss.backward()
        else:
            loss.backward()
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, 2 * first[n])
