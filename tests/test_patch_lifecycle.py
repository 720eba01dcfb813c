"""What happens to a patched model around foak.patch: copies of patched modules (copy.deepcopy, PEFT's
modules_to_save, pickle), LoRA layers added after patching (get_peft_model, inject_adapter_in_model, TRL's
SFTTrainer(peft_config=...) in tests/test_trl.py), two models sharing one config object, and restore next to other libraries'
patches. Every comparison is against the same model unpatched (fp32, loss and every gradient within 1e-5);
the kernels run on foak's reference backend (their own tests run them in the interpreter): what is checked
here is which code runs, counted in the report."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import re

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

import foak
from foak.models.tiny import tiny_config, tiny_model
from foak.testing import relative_error

TOL = 1e-5
LAYERS = 2
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True)
def _reference_backend():
    before = foak.get_backend()
    foak.set_backend("reference")
    yield
    foak.set_backend(before)


def lora_config(**kwargs) -> LoraConfig:
    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": LORA_TARGETS, "init_lora_weights": False,
                         **kwargs})


def batch(seq: int = 9, vocab: int = 128) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def copy_adapters(model, ref, prefix: str = "") -> None:
    """The adapter weights of ``ref`` into ``model`` (both initialised them from the random generator)."""
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(ref_params[prefix + name])


def loss_and_grads(model, data=None):
    model.zero_grad(set_to_none=True)
    loss = model(**(data or batch())).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_same_training(model, ref, data=None, prefix: str = "") -> int:
    """``prefix``: what the reference's parameter names have in front of the model's."""
    loss, grads = loss_and_grads(model, data)
    ref_loss, ref_grads = loss_and_grads(ref, data)
    ref_grads = {n[len(prefix):]: g for n, g in ref_grads.items()}
    assert relative_error(loss, ref_loss) <= TOL
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in grads.items():
        assert ref_grads[name] is not None, name
        assert g is not None, f"{name}: gradient None (the unpatched model's is not)"
        err = relative_error(g, ref_grads[name])
        assert err <= TOL, f"grad of {name}: relative error {err:.3g}"
    return len(grads)


def fused_calls(report) -> int:
    match = re.search(r"fused (\d+) calls?", report.result("llama.fused_lora").notes)
    return int(match.group(1)) if match else 0


# ---- copies of patched modules ------------------------------------------------------------------------


def test_deepcopy_of_patched_modules_computes_with_the_copy():
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    foak.patch(model)
    x = torch.randn(2, 5, 64)
    for path in ("model.norm", "model.layers.0.mlp", "lm_head"):
        patched, plain = copy.deepcopy(model.get_submodule(path)), copy.deepcopy(ref.get_submodule(path))
        with torch.no_grad():  # a copy that differs from its original, so computing with the original shows
            for p, q in zip(patched.parameters(), plain.parameters()):
                p.mul_(1.5)
                q.mul_(1.5)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = patched(xa), plain(xb)
        assert relative_error(out, expected) <= TOL, path
        out.square().sum().backward()
        expected.square().sum().backward()
        assert relative_error(xa.grad, xb.grad) <= TOL, path
        for (name, p), q in zip(patched.named_parameters(), plain.parameters()):
            assert p.grad is not None and relative_error(p.grad, q.grad) <= TOL, f"{path}.{name}"
        assert "forward" in vars(patched) and patched.forward.__self__ is patched  # foak's, bound to the copy
    # the originals were not used by the copies
    assert all(p.grad is None for p in model.parameters())


def test_modules_to_save_lm_head_trains_the_copy():
    base_ref = tiny_model("llama")
    ref = get_peft_model(copy.deepcopy(base_ref), lora_config(target_modules=["q_proj", "v_proj"],
                                                              modules_to_save=["lm_head"]))
    base = copy.deepcopy(base_ref)
    report = foak.patch(base)  # patched first, as TRL's and the README's order has it
    model = get_peft_model(base, lora_config(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    copy_adapters(model, ref)
    n = assert_same_training(model, ref)
    head_copy = [name for name, p in model.named_parameters() if "modules_to_save" in name and p.requires_grad]
    assert head_copy and n == LAYERS * 2 * 2 + len(head_copy)
    assert report.result("llama.fused_linear_loss").modules == 1
    foak.restore(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_pickle_of_a_patched_model_loads_patched():
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    report = foak.patch(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert foak.patching.is_patched(loaded) and foak.patching.is_patched(model)
    assert str(report).count("\n") > 3
    assert_same_training(loaded, ref)
    assert_same_training(model, ref)
    assert pickle.loads(pickle.dumps(foak.restore(loaded))) is not None
    foak.restore(model)


def test_pickle_of_a_model_patched_with_offload_loads_with_its_rules_and_budget():
    # the offload rule is not one of the architecture's own: it comes back from foak.api's rules source, budget
    # included (before, loading failed: "patched with rules this foak does not have")
    model = tiny_model("llama")
    foak.patch(model, fast_rms_layernorm=True, offload_activations=True, offload_budget_gib=8e-6)  # 1 layer
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    rows = {r.rule_id: r for r in loaded.__dict__["_foak_patch_state"].report.results}
    assert rows["llama.offload_activations"].modules == 1 and rows["llama.rms_norm"].modules > 0
    loaded.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loaded.train()
    ids = torch.randint(0, loaded.config.vocab_size, (2, 12))
    loaded(input_ids=ids, labels=ids).loss.backward()
    assert "1 of 2 checkpointed layers' inputs offloaded" in rows["llama.offload_activations"].notes, str(rows)
    foak.restore(loaded)
    foak.restore(model)


# ---- LoRA layers that appear after foak.patch --------------------------------------------------------


@pytest.mark.parametrize("order", ["get_peft_model", "inject_adapter_in_model"])
def test_lora_added_after_patch_is_fused(order):
    ref_base = tiny_model("llama")
    ref = get_peft_model(copy.deepcopy(ref_base), lora_config())
    base = copy.deepcopy(ref_base)
    report = foak.patch(base)
    if order == "get_peft_model":
        model = get_peft_model(base, lora_config())
        copy_adapters(model, ref)
    else:  # layers added to the patched model itself (what transformers' add_adapter does with peft >= 0.22)
        from peft import inject_adapter_in_model

        model = inject_adapter_in_model(lora_config(), base)
        for name, p in model.named_parameters():  # (get_peft_model freezes the base; this does not)
            p.requires_grad_("lora_" in name)
        copy_adapters(model, ref, prefix="base_model.model.")
    n = assert_same_training(model, ref, prefix="" if order == "get_peft_model" else "base_model.model.")
    assert n == LAYERS * 7 * 2
    assert report.result("llama.fused_lora").modules == LAYERS * 7, str(report)
    assert fused_calls(report) == LAYERS * 7, report.result("llama.fused_lora").notes
    assert "after foak.patch" in report.result("llama.fused_lora").notes
    assert "fused LoRA MLP blocks" in report.result("llama.swiglu").notes
    foak.restore(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_lora_added_under_a_config_without_fused_lora_is_reported():
    base = tiny_model("llama")
    report = foak.patch(base, fast_rms_layernorm=True)
    model = get_peft_model(base, lora_config())
    model(**batch())
    row = next(r for r in report.results if r.switch == "lora")
    assert row.modules == 0 and "fused_lora is off in this config" in row.notes
    foak.restore(model)


# ---- shared state: one config object, module globals --------------------------------------------------


def packed_batch(vocab: int = 128) -> dict:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (1, 11), generator=g)
    return {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]]), "labels": ids}


@pytest.mark.parametrize("arch", ["mixtral", "llama"])
def test_two_models_from_one_config(arch):
    config = tiny_config(arch)
    torch.manual_seed(0)
    a = transformers.AutoModelForCausalLM.from_config(config).float()
    b = transformers.AutoModelForCausalLM.from_config(config).float()
    b_ref = copy.deepcopy(b)
    expected = [loss_and_grads(b_ref, data) for data in (batch(), packed_batch())]
    report = foak.patch(a)
    assert report.result(f"{arch}.packed_attention").modules == 1
    if arch == "mixtral":
        assert report.result("mixtral.moe").modules == LAYERS
    for data, (ref_loss, ref_grads) in zip((batch(), packed_batch()), expected):
        loss, grads = loss_and_grads(b, data)  # the unpatched model, config shared with the patched one
        assert relative_error(loss, ref_loss) <= TOL
        assert all(relative_error(grads[n], g) <= TOL for n, g in ref_grads.items())
        a(**data).loss.backward()  # and the patched one runs its packed path
    calls = report.result(f"{arch}.packed_attention").notes
    assert re.search(r"foak varlen attention ran [1-9]", calls), calls
    foak.restore(a)
    assert config._attn_implementation == "sdpa"


ROPE = ("rope", "transformers.models.llama.modeling_llama", "apply_rotary_pos_emb")


def rope_users() -> int:
    from foak.patching import globals as globals_

    return globals_.users(ROPE)


def no_patched_llama_alive():
    gc.collect()  # patched models of earlier tests release foak's RoPE global when they are collected
    assert rope_users() == 0


def test_restore_keeps_what_others_installed_after_foak():
    from transformers.models.llama import modeling_llama

    no_patched_llama_alive()
    original = modeling_llama.apply_rotary_pos_emb
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    foak.patch(model)
    foaks = modeling_llama.apply_rotary_pos_emb
    assert foaks is not original

    def theirs(*args, **kwargs):  # another library's RoPE, installed after foak's
        return foaks(*args, **kwargs)

    modeling_llama.apply_rotary_pos_emb = theirs
    wrapped = model.forward

    def their_forward(*args, **kwargs):  # e.g. TRL's fused LM head: an instance forward set after foak's
        their_forward.calls += 1
        return wrapped(*args, **kwargs)

    their_forward.calls = 0
    model.forward = their_forward
    try:
        foak.restore(model)
        assert modeling_llama.apply_rotary_pos_emb is theirs
        assert model.forward is their_forward
        report_free = foak.patching.is_patched(model)
        assert not report_free
        assert_same_training(model, ref)  # foak's forward under theirs only passes calls on now
        assert their_forward.calls == 1
        # patched again: foak's layer under theirs is active again, in place
        report = foak.patch(model)
        assert model.forward is their_forward
        assert_same_training(model, ref)
        assert report.result("llama.fused_linear_loss").modules == 1
        foak.restore(model)
    finally:
        modeling_llama.apply_rotary_pos_emb = original


def test_patch_deepcopy_restore_both_leaves_the_originals():
    from transformers.models.llama import modeling_llama

    no_patched_llama_alive()
    original = modeling_llama.apply_rotary_pos_emb
    model = tiny_model("llama")
    foak.patch(model)
    clone = copy.deepcopy(model)
    assert rope_users() == 2 * LAYERS  # one per patched attention module
    assert foak.patching.is_patched(clone)
    foak.restore(model)
    assert modeling_llama.apply_rotary_pos_emb is not original  # the clone still uses it
    foak.restore(clone)
    assert modeling_llama.apply_rotary_pos_emb is original
    for m in (model, clone):
        assert not any("forward" in vars(module) for module in m.modules())


def test_packed_batch_with_attention_dropout_keeps_sequences_apart():
    torch.manual_seed(0)
    config = tiny_config("llama")
    config.attention_dropout = 0.5
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    report = foak.patch(model)
    embeds = model.get_input_embeddings()
    ids = torch.randint(3, 100, (1, 8))
    inputs = embeds(ids).detach().requires_grad_()
    out = model(inputs_embeds=inputs, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]), use_cache=False).logits
    out[0, 4:].square().sum().backward()  # the second sequence's outputs
    assert inputs.grad[0, :4].abs().max() == 0  # nothing of the first sequence reaches them
    assert "attention dropout" in report.result("llama.packed_attention").notes
    foak.restore(model)
