"""fast_moe (foak.patching.moe) on tiny Mixtral / Qwen3-MoE / GraniteMoE: foak's experts implementation
selected through transformers' experts interface, with every other rule on, against the same model running
HF's eager experts (``config._experts_implementation = "eager"``): loss, auxiliary load-balancing loss and
every parameter gradient (fp32 within 1e-5; bf16 with the routing checked to be identical, within 2e-2);
the report's call counts; restore; LoRA on attention beside it; configurations foak cannot compute.

Models: hidden 48, intermediate 80, 4 experts, top-2, 2 layers, vocab 61, one sequence of 17 tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import foak
from foak.patching.moe import activation_of, moe_counts
from foak.testing import relative_error

VOCAB, SEQ = 61, 17
_COMMON = {"vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1,
           "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
# arch -> (config class, causal LM class, config kwargs, MoE layers)
SPECS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}, 2),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",  # layer 0 dense (the swiglu rule), layer 1 sparse
                  {"num_experts": 4, "moe_intermediate_size": 80, "mlp_only_layers": [0], "head_dim": 12}, 1),
    # exact-erf GELU experts: the activation mapping checked in numbers, not only by name
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   {"num_local_experts": 4, "hidden_act": "gelu", "logits_scaling": 4.0, "residual_multiplier": 0.5,
                    "embedding_multiplier": 3.0, "attention_multiplier": 0.2}, 2),
}
EVERY_SWITCH = dict(fast_rms_layernorm=True, fast_rope_embeddings=True, fast_swiglu=True, fused_linear_loss=True,
                    fast_moe=True)


def build(arch: str, seed: int = 0, **overrides) -> nn.Module:
    config_cls, model_cls, kwargs, _ = SPECS[arch]
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():  # HF's init (std 0.02) leaves the experts' output near zero: larger weights
        for m in model.modules():
            if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj"):
                m.gate_up_proj.normal_(0, 0.15)
                m.down_proj.normal_(0, 0.15)
    return model


def eager_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model)
    ref.config._experts_implementation = "eager"
    return ref


def experts_of(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate")]


def batch():
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}


def step(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.aux_loss.detach(), grads


def assert_same_step(ours, ref, tol):
    loss, aux, grads = ours
    ref_loss, ref_aux, ref_grads = ref
    assert relative_error(loss, ref_loss) <= tol, (loss, ref_loss)
    assert relative_error(aux, ref_aux) <= tol, (aux, ref_aux)
    assert grads.keys() == ref_grads.keys()
    errors = {n: relative_error(g, ref_grads[n]) for n, g in grads.items()}
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"gradients over {tol}: {bad}"
    moe_grads = [n for n in grads if "experts" in n]
    assert moe_grads and all(ref_grads[n].abs().max() > 0 for n in moe_grads)


@pytest.fixture(autouse=True)
def _restore_everything():
    models = []
    yield models
    for m in models:
        foak.restore(m)


@pytest.mark.parametrize("arch", list(SPECS))
def test_fp32_every_rule_matches_eager_experts_counts_and_restores(arch, _restore_everything):
    model = build(arch)
    model.config._experts_implementation = "batched_mm"  # something other than the default, to see it restored
    ref = eager_copy(model)
    report = foak.patch(model, **EVERY_SWITCH)
    _restore_everything.append(model)
    moe_layers = SPECS[arch][3]
    row = report.result(f"{arch}.moe")
    assert (row.switch, row.modules) == ("moe", moe_layers)
    # foak's forward is on each experts module; the config (shareable with other models) is untouched
    assert model.config._experts_implementation == "batched_mm"
    assert all("forward" in vars(m) for m in experts_of(model))
    assert all(r.modules > 0 for r in report.results if r.switch != "swiglu" or arch == "qwen3_moe"), str(report)

    inputs = batch()
    assert_same_step(step(model, inputs), step(ref, inputs), 1e-5)
    assert moe_counts(report, row.rule_id) == (moe_layers, {})
    assert f"foak moe_experts ran {moe_layers} call{'s' if moe_layers > 1 else ''}" in str(report)

    foak.restore(model)
    assert model.config._experts_implementation == "batched_mm"
    assert vars(model.config)["_experts_implementation_internal"] == "batched_mm"
    assert not any("forward" in vars(m) for m in experts_of(model))
    with torch.no_grad():
        restored, ref_logits = model(input_ids=inputs["input_ids"]).logits, ref(input_ids=inputs["input_ids"]).logits
    assert relative_error(restored, ref_logits) <= 1e-5
    assert moe_counts(report, row.rule_id) == (moe_layers, {})  # HF's batched_mm ran, not foak


def _routing_recorder(model, choices):
    def hook(module, args, out):  # MixtralTopKRouter: (logits, top-k weights, top-k indices)
        choices.append(out[2])

    return [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ == "MixtralTopKRouter"]


def test_bf16_with_identical_routing_matches_eager_experts(_restore_everything):
    model = build("mixtral", seed=1).to(torch.bfloat16)
    ref = eager_copy(model)
    report = foak.patch(model, fast_moe=True, fused_linear_loss=True)
    _restore_everything.append(model)
    ours_choice, ref_choice = [], []
    hooks = _routing_recorder(model, ours_choice) + _routing_recorder(ref, ref_choice)
    inputs = batch()
    ours, theirs = step(model, inputs), step(ref, inputs)
    for h in hooks:
        h.remove()
    # a rounding difference in layer 0's output could flip a top-k choice of layer 1; the comparison below
    # only means something with the same experts chosen for every token
    assert len(ours_choice) == len(ref_choice) == 2
    assert all(torch.equal(a, b) for a, b in zip(ours_choice, ref_choice))
    assert_same_step(ours, theirs, 2e-2)
    assert moe_counts(report, "mixtral.moe") == (2, {})


def test_fp16_autocast_with_grad_scaler_over_fp32_weights(_restore_everything):
    """The fp16 users' setup: fp32 weights, fp16 autocast, GradScaler at 2**16. foak's unscaled gradients are
    finite and as close to the fp32 step of the same model as HF's eager experts under the same autocast."""
    model = build("mixtral", seed=1)
    ref = eager_copy(model)
    report = foak.patch(model, fast_moe=True)
    _restore_everything.append(model)
    inputs = batch()

    def scaled_step(m):
        m.zero_grad(set_to_none=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(**inputs).loss
        scaler.scale(loss).backward()
        return loss.detach(), {n: p.grad / scaler.get_scale() for n, p in m.named_parameters() if p.grad is not None}

    (loss, grads), (ref_loss, ref_grads) = scaled_step(model), scaled_step(ref)
    fp32 = step(ref, inputs)
    assert grads.keys() == ref_grads.keys() == fp32[2].keys()
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert relative_error(loss, fp32[0]) <= 1e-3
    ours = max(relative_error(g, fp32[2][n]) for n, g in grads.items())
    eager = max(relative_error(g, fp32[2][n]) for n, g in ref_grads.items())
    assert 0 < ours <= max(2 * eager, 1e-3), (ours, eager)
    assert moe_counts(report, "mixtral.moe") == (2, {})


def test_aux_loss_and_counts_over_several_forwards(_restore_everything):
    # evaluation forwards (no labels, no grad) run foak's experts too; the auxiliary loss reads HF's router
    model = build("granitemoe")
    ref = eager_copy(model)
    report = foak.patch(model, fast_moe=True)
    _restore_everything.append(model)
    ids = batch()["input_ids"]
    with torch.no_grad():
        for forwards in (1, 2):
            out, ref_out = model(input_ids=ids), ref(input_ids=ids)
            assert ref_out.aux_loss > 0
            assert relative_error(out.aux_loss, ref_out.aux_loss) <= 1e-6
            assert relative_error(out.logits, ref_out.logits) <= 1e-5
            assert moe_counts(report, "granitemoe.moe") == (2 * forwards, {})  # 2 MoE layers per forward
    assert report.result("granitemoe.moe").notes.endswith("foak moe_experts ran 4 calls")


def test_lora_on_attention_beside_fast_moe(_restore_everything):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(build("mixtral"), lora)
    ref = eager_copy(model)
    report = foak.patch(model, fused_lora=True, fast_moe=True)
    _restore_everything.append(model)
    assert report.count("mixtral.moe") == 2 and report.count("mixtral.fused_lora") == 4
    inputs = batch()
    ours, theirs = step(model, inputs), step(ref, inputs)
    assert set(ours[2]) == set(theirs[2]) and all("lora_" in n for n in ours[2])
    loss, aux, grads = ours
    assert relative_error(loss, theirs[0]) <= 1e-5 and relative_error(aux, theirs[1]) <= 1e-5
    assert all(relative_error(g, theirs[2][n]) <= 1e-5 for n, g in grads.items())
    assert moe_counts(report, "mixtral.moe") == (2, {})
    assert "fused 4 calls" in report.result("mixtral.fused_lora").notes


def test_unsupported_experts_are_reported_not_patched(_restore_everything):
    from transformers.activations import QuickGELUActivation

    # a whole model whose activation foak has no kernel for: nothing selected, the config untouched
    model = build("mixtral", hidden_act="quick_gelu")
    before = model.config._experts_implementation
    row = foak.patch(model, fast_moe=True).result("mixtral.moe")
    _restore_everything.append(model)
    assert row.modules == 0 and row.backend == "-"
    assert row.notes == "2 MixtralExperts modules not patched: activation QuickGELUActivation has no foak kernel " \
                        "(SiLU, GELU, tanh GELU)"
    assert model.config._experts_implementation == before
    foak.restore(model)
    # layouts the op does not take (as transformers' decorator declares them for other architectures)
    model = build("mixtral")
    experts_of(model)[0].has_bias = True
    experts_of(model)[1].is_transposed = True
    row = foak.patch(model, fast_moe=True).result("mixtral.moe")
    _restore_everything.append(model)
    assert row.modules == 0
    assert row.notes == ("1 MixtralExperts module not patched: expert biases; "
                         "1 MixtralExperts module not patched: transposed expert weights")
    foak.restore(model)

    # one layer foak cannot compute, one it can, sharing one config: the first keeps HF's computation (not
    # patched, not counted); the second's calls foak's op cannot take run HF's and are counted
    model = build("mixtral")
    experts_of(model)[1].act_fn = QuickGELUActivation()
    ref = eager_copy(model)
    report = foak.patch(model, fast_moe=True)
    _restore_everything.append(model)
    row = report.result("mixtral.moe")
    assert row.modules == 1 and model.config._experts_implementation == before
    assert "1 MixtralExperts module not patched: activation QuickGELUActivation" in row.notes
    # a setting that changes after patching is caught at call time: expert parallelism on layer 0
    experts_of(model)[0]._is_expert_parallel = True
    inputs = batch()
    with torch.no_grad():
        out, ref_out = model(**inputs), ref(**inputs)
    assert relative_error(out.loss, ref_out.loss) <= 1e-6
    foak_calls, other = moe_counts(report, "mixtral.moe")
    assert foak_calls == 0 and other == {"expert parallelism (expert ids beyond the local experts)": 1}
    assert f"the previous implementation ({before}) ran 1 call" in row.notes
    experts_of(model)[0]._is_expert_parallel = False
    with torch.no_grad():
        model(**inputs)
    assert moe_counts(report, "mixtral.moe")[0] == 1


@pytest.mark.parametrize("name,expected", [
    ("silu", "silu"), ("swish", "silu"), ("gelu", "gelu"), ("gelu_python", "gelu"),
    ("gelu_pytorch_tanh", "gelu_tanh"), ("gelu_python_tanh", "gelu_tanh"), ("gelu_new", "gelu_tanh"),
    ("gelu_fast", "gelu_tanh"), ("quick_gelu", None), ("gelu_10", None), ("gelu_accurate", None), ("relu", None),
])
def test_activation_mapping_is_by_the_module_that_runs(name, expected):
    from transformers.activations import ACT2FN

    activation, reason = activation_of(ACT2FN[name])
    assert activation == expected
    assert (reason is None) == (expected is not None)
    assert activation_of(nn.GELU(approximate="tanh")) == ("gelu_tanh", None)
    act = ACT2FN["silu"]
    act.register_forward_hook(lambda *a: None)
    assert activation_of(act)[0] is None


def test_deepcopy_is_patched_on_its_own(_restore_everything):
    patched = build("mixtral")
    foak.patch(patched, fast_moe=True)
    _restore_everything.append(patched)
    clone = copy.deepcopy(patched)  # e.g. TRL's reference model: its own patch and counts
    _restore_everything.append(clone)
    assert clone.config is not patched.config and clone.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        clone(input_ids=batch()["input_ids"])
    assert moe_counts(foak.patch(clone, fast_moe=True), "mixtral.moe") == (2, {})
    assert moe_counts(foak.patch(patched, fast_moe=True), "mixtral.moe") == (0, {})
    foak.restore(clone)
    assert not any("forward" in vars(m) for m in experts_of(clone))
    assert all("forward" in vars(m) for m in experts_of(patched))  # the original keeps its patch
