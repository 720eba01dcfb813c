"""foak.patch / foak.restore on tiny randomly initialised HF models of every supported architecture.

Every model is fp32, 2 layers, hidden 64, 4 heads / 2 kv heads, vocab 301; the comparisons are against a
deepcopy taken before patching (same weights, HF's own forward), to 1e-5 relative for the loss and every
parameter gradient.

The kernels run in the Triton interpreter inside every architecture in section 1 (fused_linear_loss: every
kernel, padded and packed batches). The other model-level sections check what the patcher does (the fast_loss
rule keeps the logits, restore, num_items_in_batch, logits when wanted, a patched model beside an unpatched
one); the replacement forwards and the op calls are the same on either backend, so they run foak's torch
reference ops (``foak.set_backend("reference")``) except for the architectures in ``KERNEL_ARCHS``, which keep
the kernels (the interpreter costs ~1-3 s per model step).
"""

from __future__ import annotations

import copy
import gc
import inspect
import sys

import pytest
import torch
import transformers
from torch import nn

import foak
from foak.config import SWITCH_TO_RULE
from foak.models import ARCHITECTURES, rules_for
from foak.patching import is_patched, replacements
from foak.testing import relative_error

TOL = 1e-5
VOCAB = 301
RULE_TO_SWITCH = {rule: switch for switch, rule in SWITCH_TO_RULE.items()}
KERNEL_RULES = ("rms_norm", "rope", "swiglu")
LOSS_RULES = ("fused_linear_loss", "loss")

# ---- the tiny models ----------------------------------------------------------------------------------

_COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
_MOE = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1}
_GRANITE = {"logits_scaling": 4.0, "residual_multiplier": 0.5, "embedding_multiplier": 3.0, "attention_multiplier": 0.2}

# arch -> (config class, causal LM class, config kwargs, expected report counts per rule)
SPECS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_COMMON),
              {"rms_norm": 5, "rope": 2, "swiglu": 2}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_COMMON, sliding_window=4),  # < the sequences used
                {"rms_norm": 5, "rope": 2, "swiglu": 2}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_COMMON, num_local_experts=4, **_MOE),
                {"rms_norm": 5, "rope": 2, "swiglu": 0}),  # fused experts: no dense gated MLP module
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(_COMMON, **_GRANITE),
                {"rms_norm": 5, "rope": 2, "swiglu": 2}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(_COMMON, num_local_experts=4, **_MOE, **_GRANITE),
                   {"rms_norm": 5, "rope": 2, "swiglu": 0}),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                    {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 96, "n_positions": 64,
                     "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 1},
                    {"rms_norm": 0, "rope": 0, "swiglu": 0}),  # LayerNorm, learned positions, GELU MLP
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_COMMON),
              {"rms_norm": 5, "rope": 2, "swiglu": 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_COMMON, head_dim=16),
              {"rms_norm": 9, "rope": 2, "swiglu": 2}),  # + q_norm / k_norm per layer
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_COMMON, head_dim=16, num_experts=4, moe_intermediate_size=48, mlp_only_layers=[0], **_MOE),
                  {"rms_norm": 9, "rope": 2, "swiglu": 1}),  # layer 0 dense (Qwen3MoeMLP), layer 1 sparse
}
ARCHS = list(SPECS)  # the architectures added later have their matrix in tests/test_architectures.py


def build(arch: str, seed: int = 0) -> nn.Module:
    config_cls, model_cls, kwargs, _ = SPECS[arch]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    assert model.config.model_type == arch
    return model


def modeling_module(model: nn.Module):
    return sys.modules[type(model).__module__]


def all_switches(loss_rule: str = "fused_linear_loss") -> dict[str, bool]:
    """Every kernel switch plus one of the two loss switches (they exclude each other)."""
    return {RULE_TO_SWITCH[r]: True for r in (*KERNEL_RULES, loss_rule)}


_PATCHED: list[nn.Module] = []
# architectures whose model-level tests beyond section 1 keep the Triton kernels: a dense one and the MoE one
# with Granite's logits scaling and multipliers
KERNEL_ARCHS = ("llama", "granitemoe")


def ops_for(arch: str) -> None:
    """The kernels for ``arch`` in KERNEL_ARCHS, foak's reference ops otherwise (until the test ends)."""
    foak.set_backend("auto" if arch in KERNEL_ARCHS else "reference")


def patch(model: nn.Module, **switches):
    """foak.patch, and the model is restored after the test (so no RoPE global outlives its test)."""
    _PATCHED.append(model)
    return foak.patch(model, **switches)


@pytest.fixture(autouse=True)
def _restore_patched_models():
    yield
    foak.set_backend("auto")
    while _PATCHED:
        foak.restore(_PATCHED.pop())


# ---- inputs ---------------------------------------------------------------------------------------------


def padded_batch(seq: int = 9) -> dict:
    """Batch 2, left padding (row 0: 1 pad, row 1: 4 pads), labels -100 at the padded positions."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :1] = 0
    mask[1, :4] = 0
    ids = ids.masked_fill(mask == 0, 2)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def packed_batch(lengths=(4, 6, 3)) -> dict:
    """Padding-free packing: one row, position_ids restarting per sequence, no attention_mask, labels -100 at
    each sequence's first token (as DataCollatorWithFlattening builds them); no cache, as in training."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(pos == 0, -100), "use_cache": False}


# ---- comparisons ----------------------------------------------------------------------------------------


def loss_and_grads(model: nn.Module, batch: dict):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str, tol: float = TOL):
    err = relative_error(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol} ({out.flatten()[:4]} vs {ref.flatten()[:4]})"


def assert_grads_close(grads: dict, ref_grads: dict, what: str):
    assert grads.keys() == ref_grads.keys()
    compared = 0
    for name, g in grads.items():
        r = ref_grads[name]
        if g is None and r is None:
            continue
        assert g is not None and r is not None, f"{what}: grad of {name} is None on one side only"
        assert_close(g, r, f"{what}: grad of {name}")
        compared += 1
    assert compared > 0


def instance_forwards(model: nn.Module) -> dict[str, object]:
    return {name: m.__dict__["forward"] for name, m in model.named_modules() if "forward" in m.__dict__}


# ---- 0. the test models cover every architecture -----------------------------------------------------


def test_every_architecture_has_a_test_model():
    from test_architectures import SPECS as MATRIX

    assert not set(SPECS) & set(MATRIX)
    assert set(SPECS) | {spec.model_type or arch for arch, spec in MATRIX.items()} == set(ARCHITECTURES)


# ---- 1. patched == unpatched: loss and every gradient ----------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_patched_matches_unpatched_fused_linear_loss(arch):
    model = build(arch)
    ref = copy.deepcopy(model)
    patch(model, **all_switches("fused_linear_loss"))
    for kind, batch in (("padded", padded_batch()), ("packed", packed_batch())):
        out, grads = loss_and_grads(model, batch)
        ref_out, ref_grads = loss_and_grads(ref, batch)
        assert out.logits is None  # training with labels: the logits are never materialised
        assert ref_out.logits is not None
        if SPECS[arch][2].get("output_router_logits"):  # the router's aux loss is part of the loss
            assert out.aux_loss is not None and ref_out.aux_loss is not None
            assert_close(out.aux_loss, ref_out.aux_loss, f"{arch} {kind} aux loss")
        assert_close(out.loss, ref_out.loss, f"{arch} {kind} loss")
        assert_grads_close(grads, ref_grads, f"{arch} {kind}")


@pytest.mark.parametrize("arch", ARCHS)
def test_patched_matches_unpatched_fast_loss(arch):
    ops_for(arch)
    model = build(arch)
    ref = copy.deepcopy(model)
    report = patch(model, **all_switches("loss"))
    assert report.count(f"{arch}.loss") == 1
    for kind, batch in (("padded", padded_batch()), ("packed", packed_batch())):
        out, grads = loss_and_grads(model, batch)
        ref_out, ref_grads = loss_and_grads(ref, batch)
        assert_close(out.logits, ref_out.logits, f"{arch} {kind} logits")  # fast_loss keeps the logits
        assert_close(out.loss, ref_out.loss, f"{arch} {kind} loss")
        assert_grads_close(grads, ref_grads, f"{arch} {kind}")


# ---- 2. the report -------------------------------------------------------------------------------------


def _count_modules(model: nn.Module, rule: str) -> int:
    """What each rule should patch, counted from the model itself (independently of foak's triggers)."""
    modules = list(model.modules())
    names = [type(m).__name__ for m in modules]
    if rule == "rms_norm":
        return sum(n.endswith("RMSNorm") for n in names)
    if rule == "rope":  # attention modules of a model that has rotary embeddings
        has_rotary = any(n.endswith("RotaryEmbedding") for n in names)
        return sum(n.endswith("Attention") for n in names) if has_rotary else 0
    if rule == "swiglu":  # dense gated MLPs (a fused-experts module has no gate_proj/up_proj/down_proj Linears)
        return sum(all(isinstance(getattr(m, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj"))
                   for m in modules)
    if rule in LOSS_RULES:
        return 1
    raise AssertionError(rule)


@pytest.mark.parametrize("loss_rule", LOSS_RULES)
@pytest.mark.parametrize("arch", ARCHS)
def test_report_counts(arch, loss_rule):
    model = build(arch)
    report = patch(model, **all_switches(loss_rule))
    assert report.model_type == arch
    expected = dict(SPECS[arch][3], **{loss_rule: 1})
    by_switch = {}
    for r in report.results:
        if r.rule_id == f"{arch}.rms_norm_recompute":  # the rms_norm switch's second rule: the decoder stack
            assert r.switch == "rms_norm" and r.modules == 1, str(report)
            continue
        assert r.switch not in by_switch, f"{r.switch} reported twice:\n{report}"
        by_switch[r.switch] = r
    assert set(by_switch) == set(expected), str(report)
    recompute = [r.modules for r in report.results if r.rule_id == f"{arch}.rms_norm_recompute"]
    assert recompute == ([1] if expected["rms_norm"] else []), str(report)
    available = {r.switch for r in rules_for(model)}
    for rule, n in expected.items():
        assert _count_modules(model, rule) == n, f"test table disagrees with the model for {rule}"
        result = by_switch[rule]
        assert result.rule_id == f"{arch}.{rule}"
        assert result.modules == n, f"{rule}: {result.modules} modules, expected {n}\n{report}"
        if n:
            assert result.backend != "-" and result.note == "", str(report)
            assert report.count(result.rule_id) == n
        else:  # reported, never silent
            assert result.backend == "-" and result.note, f"{rule} patched nothing without saying why\n{report}"
            if rule not in available:
                assert "no rule" in result.note, result.note
    # nothing was patched that the report does not account for
    patched = instance_forwards(model)
    lm_head = 1 if loss_rule == "fused_linear_loss" else 0  # the fused loss also routes the LM head
    assert len(patched) == sum(r.modules for r in report.results) + lm_head
    text = str(report)
    if loss_rule == "fused_linear_loss":
        print(text)
    for r in report.results:
        assert r.rule_id in text


# ---- 3. parameters, state_dict, save / load ------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_unchanged_and_save_load_round_trip(arch, tmp_path):
    model = build(arch)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict().keys())
    signature = inspect.signature(model.forward)  # HF Trainer picks dataset columns / loss kwargs from it
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    patch(model, **all_switches())
    assert list(model.state_dict().keys()) == keys
    assert inspect.signature(model.forward) == signature
    after = list(model.named_parameters())
    assert [n for n, _ in after] == [n for n, _ in params]
    assert all(p is q for (_, p), (_, q) in zip(after, params))
    assert all(b is c for (_, b), (_, c) in zip(model.named_buffers(), buffers))

    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert not is_patched(loaded) and not instance_forwards(loaded)
    state, loaded_state = model.state_dict(), loaded.state_dict()
    assert list(loaded_state) == list(state)
    for k in state:
        assert torch.equal(loaded_state[k], state[k]), k
    batch = padded_batch()
    loaded.train()
    with torch.no_grad():
        assert_close(loaded(**batch).loss, ref(**batch).loss, f"{arch} loaded loss", tol=1e-6)


# ---- 4. restore / double apply -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_restore_and_double_apply(arch):
    ops_for(arch)
    model = build(arch)
    ref = copy.deepcopy(model)
    modeling = modeling_module(model)
    gc.collect()  # patched models other tests dropped without restore() release the dispatcher when collected
    original_rope = getattr(modeling, "apply_rotary_pos_emb", None)
    assert not hasattr(original_rope, "__foak_original__"), "a RoPE dispatcher leaked from an earlier test"
    assert not instance_forwards(model) and "_loss_function" not in model.__dict__

    report = patch(model, **all_switches())
    forwards = instance_forwards(model)
    assert forwards
    assert foak.patch(model, **all_switches()) is report  # no-op, same report
    assert instance_forwards(model) == forwards
    assert all(instance_forwards(model)[n] is f for n, f in forwards.items())  # nothing wrapped twice
    if SPECS[arch][3]["rope"]:
        dispatcher = modeling.apply_rotary_pos_emb
        assert dispatcher.__foak_original__ is original_rope  # installed once, over the original
    # use the patched model once (the fused loss swaps loss functions around its forward)
    small = padded_batch(seq=5)
    assert model(**small).logits is None
    with torch.no_grad():
        model(**small)

    assert foak.restore(model) is model
    assert not is_patched(model)
    assert not instance_forwards(model), "an instance forward survived restore"
    assert "_loss_function" not in model.__dict__ and not hasattr(model, "_loss_function")
    assert getattr(modeling, "apply_rotary_pos_emb", None) is original_rope
    for name, m in model.named_modules():
        assert m.forward.__func__ is type(m).forward, name
    assert foak.restore(model) is model  # restoring again is harmless

    batch = padded_batch()
    out, grads = loss_and_grads(model, batch)
    ref_out, ref_grads = loss_and_grads(ref, batch)
    assert torch.equal(out.loss, ref_out.loss)
    assert torch.equal(out.logits, ref_out.logits)
    assert_grads_close(grads, ref_grads, f"{arch} restored")


# ---- 5. a patched and an unpatched model in one process -----------------------------------------------

_KERNELS = ("rms_norm", "rope", "glu", "glu_linear", "cross_entropy", "linear_cross_entropy")


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of every foak op the replacement forwards use (they look them up at call time)."""
    calls = dict.fromkeys(_KERNELS, 0)
    for name in _KERNELS:
        fn = getattr(replacements, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(replacements, name, counted)
    return calls


@pytest.mark.parametrize("arch", ARCHS)
def test_patched_and_unpatched_side_by_side(arch, kernel_calls):
    ops_for(arch)
    patched_model = build(arch)
    plain = copy.deepcopy(patched_model)
    batch = padded_batch(seq=7)
    baseline, baseline_grads = loss_and_grads(plain, batch)
    assert not any(kernel_calls.values())

    report = patch(patched_model, **all_switches())
    out, grads = loss_and_grads(plain, batch)
    assert not any(kernel_calls.values()), f"the unpatched model ran foak kernels: {kernel_calls}"
    assert torch.equal(out.loss, baseline.loss) and torch.equal(out.logits, baseline.logits)
    for name, g in grads.items():
        assert (g is None) == (baseline_grads[name] is None) and (g is None or torch.equal(g, baseline_grads[name]))

    p_out, p_grads = loss_and_grads(patched_model, batch)
    expected = {"rms_norm": SPECS[arch][3]["rms_norm"] > 0, "rope": SPECS[arch][3]["rope"] > 0,
                "glu": False,  # the plain nn.Linear down_proj takes the fused glu_linear path
                "glu_linear": SPECS[arch][3]["swiglu"] > 0, "linear_cross_entropy": True, "cross_entropy": False}
    assert {k: v > 0 for k, v in kernel_calls.items()} == expected, (kernel_calls, str(report))
    if expected["rms_norm"]:
        assert kernel_calls["rms_norm"] == SPECS[arch][3]["rms_norm"]
    assert_close(p_out.loss, baseline.loss, f"{arch} patched loss next to an unpatched model")
    assert_grads_close(p_grads, baseline_grads, arch)

    before = dict(kernel_calls)
    with torch.no_grad():
        again = plain(**batch)
    assert kernel_calls == before
    assert torch.equal(again.loss, baseline.loss)


# ---- 6. unknown architecture --------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=1)),
    lambda: transformers.PhiForCausalLM(transformers.PhiConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        bos_token_id=0, eos_token_id=1)),
], ids=["gpt2", "phi"])
def test_unknown_architecture(make):
    model = make()
    with pytest.raises(ValueError) as info:
        foak.patch(model, **all_switches())
    message = str(info.value)
    assert model.config.model_type in message
    assert "Supported architectures" in message
    for arch in ARCHITECTURES:
        assert arch in message
    assert not is_patched(model) and not instance_forwards(model)
    with pytest.raises(ValueError, match="Supported architectures"):
        rules_for(model)


def test_model_without_config():
    with pytest.raises(ValueError, match="model_type"):
        foak.patch(nn.Linear(2, 2), fast_rms_layernorm=True)


# ---- 7. logits when they are wanted -------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_linear_loss_logits_when_wanted(arch):
    ops_for(arch)
    model = build(arch)
    ref = copy.deepcopy(model)
    patch(model, **all_switches("fused_linear_loss"))
    batch = padded_batch(seq=7)
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        ref_out = ref(**batch)

    out = model(**no_labels)  # grad enabled, no labels: logits wanted
    assert out.loss is None and out.logits is not None
    assert_close(out.logits, ref_out.logits, f"{arch} logits (labels=None)")

    with torch.no_grad():  # evaluation with labels: logits and loss
        out = model(**batch)
    assert out.logits is not None
    assert_close(out.logits, ref_out.logits, f"{arch} logits (no_grad)")
    assert_close(out.loss, ref_out.loss, f"{arch} loss (no_grad)")

    out = model(**batch)  # training again: the fused loss is back
    assert out.logits is None
    assert_close(out.loss, ref_out.loss, f"{arch} loss (training after eval)")


# ---- 8. num_items_in_batch -----------------------------------------------------------------------------


@pytest.mark.parametrize("loss_rule", LOSS_RULES)
@pytest.mark.parametrize("arch", ARCHS)
def test_num_items_in_batch(arch, loss_rule):
    ops_for(arch)
    model = build(arch)
    ref = copy.deepcopy(model)
    patch(model, **all_switches(loss_rule))
    batch = padded_batch(seq=7)
    n_valid = int((batch["labels"][:, 1:] != -100).sum())
    batch["num_items_in_batch"] = torch.tensor(3 * n_valid)  # e.g. gradient accumulation over 3 micro-batches
    out, grads = loss_and_grads(model, batch)
    ref_out, ref_grads = loss_and_grads(ref, batch)
    mean_loss = ref(**{k: v for k, v in batch.items() if k != "num_items_in_batch"}).loss
    assert relative_error(ref_out.loss, mean_loss) > 0.1  # the argument does change the loss
    assert_close(out.loss, ref_out.loss, f"{arch} {loss_rule} loss with num_items_in_batch")
    assert_grads_close(grads, ref_grads, f"{arch} {loss_rule} num_items_in_batch")


# ---- rules whose precondition fails are reported; other gated activations ---------------------------


def test_rule_that_cannot_apply_is_reported():
    config_cls, model_cls, kwargs, _ = SPECS["llama"]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**dict(kwargs, hidden_act="relu")))
    report = patch(model, **all_switches())
    swiglu = next(r for r in report.results if r.switch == "swiglu")
    assert swiglu.modules == 0 and swiglu.backend == "-"
    assert "not applied" in swiglu.note and "relu" in swiglu.note, swiglu.note
    assert "relu" in str(report)
    assert report.count("llama.rms_norm") == 5  # the others still apply
    assert all(type(m).forward is m.forward.__func__ for m in model.modules() if type(m).__name__ == "LlamaMLP")


def test_geglu_mlp_matches_unpatched():
    config_cls, model_cls, kwargs, _ = SPECS["llama"]
    config = getattr(transformers, config_cls)(**dict(kwargs, hidden_act="gelu_pytorch_tanh"))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    ref = copy.deepcopy(model)
    assert patch(model, fast_swiglu=True).count("llama.swiglu") == 2
    batch = padded_batch(seq=5)
    out, grads = loss_and_grads(model, batch)
    ref_out, ref_grads = loss_and_grads(ref, batch)
    assert_close(out.loss, ref_out.loss, "geglu loss")
    assert_grads_close(grads, ref_grads, "geglu")


# ---- regressions of bugs found while writing these tests ------------------------------------------


def test_fused_linear_loss_return_dict_false():
    model = build("llama")
    ref = copy.deepcopy(model)
    patch(model, fused_linear_loss=True)
    batch = padded_batch(seq=5)
    out = model(**batch, return_dict=False)
    assert_close(out[0], ref(**batch).loss, "loss (return_dict=False)")


def test_rms_norm_with_gradient_checkpointing():
    model = build("llama")
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.activation_checkpointing_enable()  # transformers' default: non-reentrant torch.utils.checkpoint
        m.train()
    patch(model, fast_rms_layernorm=True)
    batch = padded_batch(seq=5)
    out, grads = loss_and_grads(model, batch)
    ref_out, ref_grads = loss_and_grads(ref, batch)
    assert_close(out.loss, ref_out.loss, "loss with gradient checkpointing")
    assert_grads_close(grads, ref_grads, "gradient checkpointing")


def test_deepcopy_of_a_patched_model():
    model = build("llama")
    patch(model, fast_rms_layernorm=True)
    clone = copy.deepcopy(model)
    _PATCHED.append(clone)
    with torch.no_grad():
        clone.model.norm.weight.mul_(2.0)
        expected = build("llama")
        expected.load_state_dict(clone.state_dict())  # the clone's own weights, HF's forward
        batch = padded_batch(seq=5)
        assert_close(clone(**batch).logits, expected(**batch).logits, "deepcopy of a patched model")
    # each copy owns its patch: restoring the clone leaves the original patched, then both restore cleanly
    assert foak.patching.is_patched(clone) and foak.patching.is_patched(model)
    foak.restore(clone)
    assert foak.patching.is_patched(model) and "forward" in model.model.norm.__dict__
    foak.restore(model)
    assert "forward" not in model.model.norm.__dict__


def test_deepcopy_then_restore_both_with_every_rule():
    model = build("llama")
    modeling = sys.modules[type(model).__module__]
    gc.collect()  # models other tests patched and dropped release the RoPE dispatcher when collected
    original_rope = modeling.apply_rotary_pos_emb
    assert not hasattr(original_rope, "__foak_original__")
    patch(model, fast_rms_layernorm=True, fast_rope_embeddings=True, fast_swiglu=True, fused_linear_loss=True)
    clone = copy.deepcopy(model)
    batch = padded_batch(seq=5)
    assert_close(clone(**batch).loss, model(**batch).loss, "loss of a deepcopy of a patched model")
    foak.restore(clone)
    assert modeling.apply_rotary_pos_emb is not original_rope  # the original still needs the dispatcher
    foak.restore(model)
    assert modeling.apply_rotary_pos_emb is original_rope


def test_patching_again_with_other_switches_is_an_error():
    model = build("llama")
    report = patch(model, fast_rms_layernorm=True)
    assert patch(model, fast_rms_layernorm=True) is report
    with pytest.raises(ValueError, match=r"already patched with \['llama.rms_norm', 'llama.rms_norm_recompute'\]; call foak.restore"):
        patch(model, fast_rms_layernorm=True, fast_rope_embeddings=True)


def test_every_kernel_with_gradient_checkpointing():
    model = build("llama")
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.gradient_checkpointing_enable()
        m.train()
    patch(model, **all_switches())
    batch = padded_batch(seq=5)
    out, grads = loss_and_grads(model, batch)
    ref_out, ref_grads = loss_and_grads(ref, batch)
    assert_close(out.loss, ref_out.loss, "loss with gradient checkpointing, all kernels")
    assert_grads_close(grads, ref_grads, "gradient checkpointing, all kernels")


# ---- the report tells what runs when it is read --------------------------------------------------------


@pytest.fixture
def auto_backend():
    yield
    foak.set_backend("auto")


def test_report_backend_is_read_at_call_time_not_at_patch_time(auto_backend, monkeypatch):
    model = build("llama")
    report = patch(model, **all_switches())
    row = report.result("llama.rms_norm")
    assert row.backend == "triton (interpreter) on cpu"  # conftest: TRITON_INTERPRET=1
    assert "backend setting auto: triton on CUDA, triton (interpreter) on CPU" in str(report)
    foak.set_backend("reference")  # after patching: the report follows
    assert row.backend == "reference on cpu (forced)"
    assert "backend setting reference (forced)" in str(report)
    foak.set_backend("triton")
    assert row.backend == "triton (interpreter) on cpu (forced)"
    foak.set_backend("auto")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # what dispatch does on a CPU-only machine
    assert row.backend == "reference on cpu"
    assert "backend setting auto: triton on CUDA, reference on CPU, reference on other devices" in str(report)
    foak.set_backend("triton")  # would fail at call time: the report says so instead of raising
    assert row.backend.startswith("error on cpu: backend forced to 'triton'")
    str(report)
    foak.set_backend("auto")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # the model moves after patching (as the HF Trainer moves it to the GPU): the column follows it
    model.model.layers[1].to("meta")
    assert row.backend == "triton (interpreter) on cpu, reference on meta"
    model.to("meta")
    assert row.backend == "reference on meta"
    assert all(r.backend == "-" for r in report.results if r.modules == 0)


def test_runs_on_names_what_each_device_gets(auto_backend, monkeypatch):
    from foak import backend

    assert backend.runs_on("cuda") == "triton on cuda"  # describe() looks only at the device type
    assert backend.runs_on(torch.device("cpu")) == "triton (interpreter) on cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backend.runs_on("cpu") == "reference on cpu"
    assert backend.policy() == "auto: triton on CUDA, reference on CPU, reference on other devices"
    foak.set_backend("triton")
    assert backend.policy() == "triton (forced): triton on CUDA, error on CPU"
    assert backend.runs_on("cuda") == "triton on cuda (forced)"


def test_rules_note_what_happens_at_call_time():
    model = build("llama")
    report = patch(model, **all_switches())
    row = report.result("llama.swiglu")  # a row no rule annotates by itself
    assert row.notes == "" and row.runtime == {}
    row.note_runtime("calls", "ran 1 time")
    row.note_runtime("calls", "ran 2 times")  # one note per key
    row.note_runtime("other", "something else")
    assert row.notes == "ran 2 times; something else"
    line = next(l for l in str(report).splitlines() if l.startswith("llama.swiglu"))
    assert line.endswith("ran 2 times; something else")
    row.note_runtime("other", None)
    assert row.runtime == {"calls": "ran 2 times"}
    import pickle

    assert pickle.loads(pickle.dumps(report)).result("llama.swiglu").notes == "ran 2 times"


def test_the_report_stays_live_across_a_deepcopy():
    # a deepcopy restores and re-patches the original: the report its user holds must stay the one updated
    model = build("llama")
    model.train()
    report = patch(model, **all_switches())
    clone = copy.deepcopy(model)
    _PATCHED.append(clone)
    assert foak.patch(model, **all_switches()) is report
    batch = padded_batch(seq=5)
    with torch.autograd.graph.save_on_cpu():
        model(**batch).loss.backward()
    note = report.result("llama.rms_norm_recompute").notes
    assert note.startswith("recompute stepped aside in 1 of 1 forwards (an outer saved-tensor hook was active: "), note
    assert "save_on_cpu" in note
    assert report.result("llama.rms_norm_recompute") in report.results
    assert foak.patch(clone, **all_switches()).result("llama.rms_norm_recompute").notes == ""


def test_an_unpatched_model_in_another_thread_keeps_hf_rope(kernel_calls):
    # the RoPE dispatcher's "inside a patched attention" flag is per thread: while a patched attention
    # forward is running, an unpatched Llama run by another thread computes HF's function
    import threading

    patched, plain = build("llama"), build("llama")
    ref = copy.deepcopy(plain)
    patch(patched, fast_rope_embeddings=True)
    batch = padded_batch(seq=5)
    seen = {}

    def run_plain_in_a_thread(module, args):
        if "loss" in seen:
            return
        seen["flag in the patched thread"] = replacements._ROPE_ACTIVE.on
        before = kernel_calls["rope"]
        worker = threading.Thread(target=lambda: seen.update(loss=plain(**batch).loss))
        worker.start()
        worker.join()
        seen["foak rope calls of the other thread"] = kernel_calls["rope"] - before

    handle = patched.model.layers[0].self_attn.q_proj.register_forward_pre_hook(run_plain_in_a_thread)
    try:
        patched(**batch)
    finally:
        handle.remove()
    assert seen["flag in the patched thread"] is True
    assert seen["foak rope calls of the other thread"] == 0
    assert torch.equal(seen["loss"], ref(**batch).loss)
    assert kernel_calls["rope"] == 2  # the patched model's two layers
