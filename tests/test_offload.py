"""offload_activations (foak.patching.offload): under HF's gradient checkpointing the checkpointed layers'
inputs are kept in (pinned, on CUDA) host memory until their recompute. On CPU the same hooks keep a separate
host copy (no streams): the tests check that the offloaded run equals the plain one (loss and every gradient,
fp32), that the saved inputs really went through the offload path (counted, and the host copies are distinct
storages), the budget (the first layers offloaded, the rest kept), the clear error when host memory cannot be
allocated, the config/keyword plumbing, and that foak's rms_norm_recompute scope does not step aside.
Torch reference backend (the kernels are not what is tested here)."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

import foak
from foak.models.tiny import model_from_config, tiny_config, tiny_model
from foak.patching import offload

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KERNELS = dict(fast_rms_layernorm=True, fast_rope_embeddings=True, fast_swiglu=True, fused_linear_loss=True,
               fast_packed_attention=True)
ROWS, WIDTH = 2, 12


@pytest.fixture(autouse=True)
def _reference(reference_ops):
    yield


def build(arch: str, lora: bool, reentrant: bool | None, layers: int | None = None):
    if layers is None:
        model = tiny_model(arch, seed=0)
    else:
        config = tiny_config(arch)
        config.num_hidden_layers = layers
        torch.manual_seed(0)
        model = model_from_config(config).float()
    model.config.use_cache = False
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
        if reentrant:  # reentrant checkpointing needs an input that requires grad (as HF Trainer sets up)
            model.enable_input_require_grads()
    return model


def stack_of(model):
    return next(m for m in model.modules() if offload._is_decoder_stack(m, model))


def packed_batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (ROWS, WIDTH), generator=g)
    pos = torch.tensor([list(range(5)) + list(range(7)), list(range(8)) + list(range(4))])  # two sequences a row
    return {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}


def step(model, data):
    model.zero_grad(set_to_none=True)
    loss = model(**data).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def assert_same(ref, ours):
    (loss_a, grads_a), (loss_b, grads_b) = ref, ours
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-5, msg=name)


_CASES = [(arch, lora, reentrant) for arch in ("llama", "qwen3_moe") for lora in (False, True)
          for reentrant in (False, True)]


@pytest.mark.parametrize(("arch", "lora", "reentrant"), _CASES,
                         ids=[f"{a}-{'lora' if lo else 'full'}-{'reentrant' if r else 'nonreentrant'}"
                              for a, lo, r in _CASES])
def test_offloaded_equals_plain(arch, lora, reentrant, monkeypatch):
    ref = build(arch, lora, reentrant)
    model = copy.deepcopy(ref)
    switches = dict(KERNELS, **({"fused_lora": True} if lora else {}), **({"fast_moe": True} if "moe" in arch else {}))
    foak.patch(ref, **switches)
    report = foak.patch(model, **switches, offload_activations=True)
    copies = []
    real = offload._host_buffer
    monkeypatch.setattr(offload, "_host_buffer", lambda t: copies.append(t) or real(t))
    data = packed_batch(model.config.vocab_size)
    try:
        expected, got = step(ref, data), step(model, data)
    finally:
        foak.restore(model)
        foak.restore(ref)
    assert_same(expected, got)
    stack = stack_of(model)
    stats = offload.state_of(stack)
    layers = len(stack.layers)
    hidden = model.config.hidden_size
    # LoRA: the frozen embedding's output is a leaf that requires grad (HF's enable_input_require_grads, on with
    # checkpointing): autograd holds it anyway, so layer 0's input stays where it is, reported
    leaves = 1 if lora else 0
    offloaded = layers - leaves
    # one saved input per checkpointed layer: its hidden states [rows, width, hidden] in fp32, each on the host
    assert (stats["layers"], stats["offloaded_layers"], stats["kept_layers"], stats["leaf_layers"]) == \
        (layers, offloaded, 0, leaves), stats
    assert stats["offloaded_bytes"] == offloaded * ROWS * WIDTH * hidden * 4, stats
    # each input's host copy: its bytes in one piece here (inputs smaller than offload._PIECE_BYTES)
    assert len(copies) == offloaded and all(t.dtype == torch.uint8 and t.numel() == ROWS * WIDTH * hidden * 4
                                            for t in copies)
    row = report.result(f"{model.config.model_type}.offload_activations")
    assert row.modules == 1 and f"{offloaded} of {layers} checkpointed layers' inputs offloaded" in row.notes
    assert ("1 kept on the device: a leaf of the autograd graph" in row.notes) == bool(lora), row.notes
    # the rms_norm_recompute scope is entered outside the per-layer hooks: it acts, it does not step aside
    recompute = next(r for r in report.results if r.rule_id.endswith("rms_norm_recompute"))
    assert "stepped aside" not in recompute.notes, recompute.notes
    packed = next(r for r in report.results if r.rule_id.endswith("packed_attention"))
    assert "foak varlen attention ran 0 calls" not in packed.notes, packed.notes  # the packed path ran


def test_saved_inputs_leave_the_autograd_graph():
    # what autograd holds for each checkpointed layer is foak's handle, whose host copy is a distinct storage;
    # an outer hook would see nothing of these inputs (ours are innermost around the checkpoint's save)
    model = build("llama", lora=False, reentrant=False)
    foak.patch(model, offload_activations=True)
    data = packed_batch(model.config.vocab_size)
    seen = []
    real_pack = offload._Session.pack

    def pack(self, t, layer):
        handle = real_pack(self, t, layer)
        seen.append((t.untyped_storage().data_ptr(), handle))
        return handle

    offload._Session.pack = pack
    try:
        loss = model(**data).loss
    finally:
        offload._Session.pack = real_pack
    assert len(seen) == len(stack_of(model).layers)
    for ptr, handle in seen:
        assert isinstance(handle, offload._Offloaded) and handle.kept is None
        assert all(piece.untyped_storage().data_ptr() != ptr for piece in handle.host)
    loss.backward()
    budget = seen[0][1].budget
    del seen, handle
    assert budget.in_use == 0  # released when autograd dropped the handles after the backward
    foak.restore(model)


def test_host_bytes_count_what_the_pinned_allocator_takes():
    # CUDA's caching host allocator rounds each pinned block up to a power of two: in pieces of 256 MiB and one
    # tail the input of a 409,600-token Llama-8B layer (3.125 GiB) pins exactly 3.125 GiB, not 4
    mib = 2**20
    assert offload._PIECE_BYTES == 256 * mib
    assert offload.host_bytes(409600 * 4096 * 2, pinned=True) == 409600 * 4096 * 2
    assert offload.host_bytes(2 * 256 * mib + 100 * mib, pinned=True) == 2 * 256 * mib + 128 * mib
    assert offload.host_bytes(3 * mib + 1, pinned=True) == 4 * mib
    assert offload.host_bytes(3 * mib + 1, pinned=False) == 3 * mib + 1
    assert offload._pieces(2 * 256 * mib + 5) == [(0, 256 * mib), (256 * mib, 512 * mib), (512 * mib, 512 * mib + 5)]


def test_the_row_says_how_torch_pins_and_agrees_with_what_foak_train_sets():
    """The offload row's pinning text follows torch's allocator settings (PYTORCH_ALLOC_CONF first, as torch reads
    it); the settings foak train adds for a run that offloads read as cudaHostRegister on 8 threads."""
    from foak.alloc_conf import PINNED_HOST_SETTINGS

    assert offload.pinning({}).startswith("pinned by cudaHostAlloc, torch's default")
    plain = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert offload.pinning(plain).startswith("pinned by cudaHostAlloc")
    foak_train = ",".join(f"{k}:{v}" for k, v in PINNED_HOST_SETTINGS.items())
    assert offload.pinning({"PYTORCH_CUDA_ALLOC_CONF": foak_train}) == "pinned by cudaHostRegister on 8 threads"
    assert offload.pinning({"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:True"}) == (
        "pinned by cudaHostRegister on 1 thread")
    both = {"PYTORCH_ALLOC_CONF": "pinned_use_cuda_host_register:False", "PYTORCH_CUDA_ALLOC_CONF": foak_train}
    assert offload.pinning(both).startswith("pinned by cudaHostAlloc")  # torch reads PYTORCH_ALLOC_CONF
    # the hint names the very settings foak train sets
    assert foak_train in offload.pinning({})


def test_inputs_in_many_pieces_come_back_whole(monkeypatch):
    # pieces far smaller than an input (and a tail): the offloaded run still equals the plain one, each input's
    # pieces are distinct host tensors covering its bytes exactly once
    monkeypatch.setattr(offload, "_PIECE_BYTES", 1000)
    ref = build("llama", lora=True, reentrant=False)
    model = copy.deepcopy(ref)
    foak.patch(ref, **KERNELS, fused_lora=True)
    foak.patch(model, **KERNELS, fused_lora=True, offload_activations=True)
    copies = []
    real = offload._host_buffer
    monkeypatch.setattr(offload, "_host_buffer", lambda t: copies.append(t) or real(t))
    data = packed_batch(model.config.vocab_size)
    try:
        expected, got = step(ref, data), step(model, data)
    finally:
        foak.restore(model)
        foak.restore(ref)
    assert_same(expected, got)
    per_layer = ROWS * WIDTH * model.config.hidden_size * 4
    layers = len(stack_of(model).layers) - 1  # (LoRA: layer 0's input is a graph leaf, not offloaded)
    assert per_layer % 1000 != 0 and len(copies) == layers * -(-per_layer // 1000)
    assert sum(t.numel() for t in copies) == layers * per_layer
    assert offload.state_of(stack_of(model))["offloaded_bytes"] == layers * per_layer


def test_budget_offloads_the_first_layers_and_keeps_the_rest():
    ref = build("llama", lora=False, reentrant=False, layers=4)
    layers = len(stack_of(ref).layers)
    assert layers == 4
    per_layer = ROWS * WIDTH * ref.config.hidden_size * 4
    model = copy.deepcopy(ref)
    report = foak.patch(model, offload_activations=True, offload_budget_gib=(2 * per_layer + 1) / 2**30)
    data = packed_batch(model.config.vocab_size)
    expected, got = step(ref, data), step(model, data)
    assert_same(expected, got)
    stats = offload.state_of(stack_of(model))
    assert (stats["offloaded_layers"], stats["kept_layers"]) == (2, layers - 2), stats
    assert stats["offloaded_bytes"] == 2 * per_layer
    row = report.result("llama.offload_activations")
    assert f"2 of {layers} checkpointed layers' inputs offloaded" in row.notes
    assert f"{layers - 2} kept on the device: budget" in row.notes
    # the budget is per step: the next step offloads the same two layers again
    step(model, data)
    assert offload.state_of(stack_of(model))["offloaded_layers"] == 2
    foak.restore(model)


def test_host_memory_exhausted_is_a_clear_error(monkeypatch):
    model = build("llama", lora=False, reentrant=True)
    foak.patch(model, offload_activations=True)

    def no_memory(like):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(offload, "_host_buffer", no_memory)
    data = packed_batch(model.config.vocab_size)
    with pytest.raises(offload.OffloadError, match=r"could not allocate .* host memory for the input of "
                                                    r"checkpointed layer 0 .*Lower offload_budget_gib"):
        model(**data)
    # the layers' checkpoint functions are restored, the budget is released: a later step runs normally
    monkeypatch.undo()
    stack = stack_of(model)
    assert all(not getattr(layer._gradient_checkpointing_func, "__name__", "") == "run" for layer in stack.layers)
    model(**data).loss.backward()
    assert offload.state_of(stack)["offloaded_layers"] == len(stack.layers)
    foak.restore(model)


def test_budget_larger_than_the_machine_is_refused():
    model = build("llama", lora=False, reentrant=False)
    with pytest.raises(ValueError, match=r"offload_budget_gib=1e\+06 is more than this machine's RAM"):
        foak.patch(model, offload_activations=True, offload_budget_gib=1e6)


def test_without_checkpointing_nothing_is_offloaded_and_the_row_says_so():
    model = build("llama", lora=False, reentrant=None)
    report = foak.patch(model, offload_activations=True)
    model(**packed_batch(model.config.vocab_size)).loss.backward()
    assert "1 training forward(s) without gradient checkpointing: nothing offloaded" in \
        report.result("llama.offload_activations").notes
    assert "offloaded_layers" not in offload.state_of(stack_of(model))
    foak.restore(model)


def test_config_keys():
    from foak.config import config_from_kwargs, load_config

    cfg = load_config({"training": {"fused_ops_and_kernels": {"offload_activations": True,
                                                              "offload_budget_gib": 8}}})
    assert cfg.offload_activations and cfg.offload_budget_gib == 8 and "offload_activations" in cfg.enabled_rules()
    with pytest.raises(ValueError, match="only applies with offload_activations: true"):
        config_from_kwargs(offload_budget_gib=4.0)
    with pytest.raises(ValueError, match="must be a positive number"):
        config_from_kwargs(offload_activations=True, offload_budget_gib=0.0)
    for garbage in (".nan", ".inf"):  # YAML floats that int() refused with an unclear error when patching
        with pytest.raises(ValueError, match=r"offload_budget_gib: (nan|inf) in .*must be a positive number of GiB"):
            load_config(yaml.safe_load(f"training:\n  fused_ops_and_kernels:\n    offload_activations: true\n"
                                       f"    offload_budget_gib: {garbage}\n"))
    with pytest.raises(ValueError, match="did you mean 'offload_activations'"):
        config_from_kwargs(offload_activation=True)


def test_under_an_outer_save_on_cpu():
    # an outer saved-tensor hook (torch's save_on_cpu) around the whole model: foak's per-layer hooks are still
    # the innermost around the checkpoint's save, so the layer inputs go through the offload (and its budget);
    # everything else goes to save_on_cpu, and the RMSNorm recompute steps aside as documented
    ref = build("llama", lora=False, reentrant=False)
    model = copy.deepcopy(ref)
    foak.patch(ref, **KERNELS)
    report = foak.patch(model, **KERNELS, offload_activations=True)
    data = packed_batch(model.config.vocab_size)
    with torch.autograd.graph.save_on_cpu():
        expected = step(ref, data)
    with torch.autograd.graph.save_on_cpu():
        got = step(model, data)
    assert_same(expected, got)
    stack = stack_of(model)
    assert offload.state_of(stack)["offloaded_layers"] == len(stack.layers)
    assert "stepped aside in 1 of 1 forwards" in report.result("llama.rms_norm_recompute").notes
    foak.restore(model)
    foak.restore(ref)


def test_lora_leaf_input_is_not_copied_and_the_users_order_is_reported_truthfully():
    """The order users write: foak.patch, then get_peft_model, then gradient_checkpointing_enable (as HF Trainer's
    ``gradient_checkpointing=True`` does), then gradient_checkpointing_disable. With the embedding frozen, HF's
    enable_input_require_grads makes its output a leaf that requires grad: autograd's AccumulateGrad holds it until
    the backward, so a host copy of layer 0's input freed nothing and cost host memory while the row said "2 of 2
    offloaded". Now it stays where it is (said), the step keeps no more than without offloading, and after
    checkpointing is turned off the row no longer says the last forward offloaded anything."""
    from memory_utils import step_memory
    from peft import LoraConfig, get_peft_model

    model = build("llama", lora=False, reentrant=None)
    report = foak.patch(model, offload_activations=True)
    # (the same random draws for the LoRA weights as build's: the model is seeded, patching draws nothing)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    ref = build("llama", lora=True, reentrant=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    data = packed_batch(model.config.vocab_size)
    assert_same(step(ref, data), step(model, data))
    stack, layers = stack_of(model), len(stack_of(model).layers)
    stats = offload.state_of(stack)
    assert (stats["offloaded_layers"], stats["leaf_layers"], stats["kept_layers"]) == (layers - 1, 1, 0), stats
    row = report.result("llama.offload_activations")
    assert f"{layers - 1} of {layers} checkpointed layers' inputs offloaded" in row.notes, row.notes
    assert "1 kept on the device: a leaf of the autograd graph" in row.notes, row.notes
    # what the forward keeps: the same bytes as without offloading (on the CPU the host copies count too: a copy
    # of the leaf was one layer input more)
    plain = build("llama", lora=True, reentrant=False)
    assert step_memory(model, data)["retained"] == step_memory(plain, data)["retained"]
    model.gradient_checkpointing_disable()
    model(**data).loss.backward()
    assert "inputs offloaded" not in row.notes, row.notes
    assert "1 training forward(s) without gradient checkpointing: nothing offloaded" in row.notes, row.notes
    assert "offloaded_layers" not in offload.state_of(stack)
    foak.restore(model)


def test_under_torch_compile_the_rows_say_nothing_is_offloaded_or_tiled():
    # the compiled forward runs without the saved-tensor hooks and the MLP whole: said in the rows (they said
    # nothing before: a patched model looked as if it offloaded and tiled)
    ref = build("llama", lora=False, reentrant=False)
    model = copy.deepcopy(ref)
    report = foak.patch(model, offload_activations=True, tiled_mlp=True, tiled_mlp_chunk_tokens=8)
    data = packed_batch(model.config.vocab_size)
    expected = step(ref, data)
    loss = torch.compile(model, backend="eager")(**data).loss  # (dynamo traces; no inductor compile here)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected[0], rtol=1e-5, atol=1e-5)
    assert "offloaded_layers" not in offload.state_of(stack_of(model))
    assert "torch.compile traced the decoder stack 1 time(s): its compiled forwards offload nothing" in \
        report.result("llama.offload_activations").notes
    assert "torch.compile traced 2 MLP forward(s): compiled, the MLP runs whole (not tiled)" in \
        report.result("llama.tiled_mlp").notes
    foak.restore(model)
