"""foak serves every output TRL 1.16's fused LM head (``trl.trainer.utils._ChunkedLogProbFunction``) can be
asked for, as its SFT, DPO, KTO, GRPO and RLOO trainers and their reference models ask, vs TRL's own kernel
on the same inputs: outputs, gradients through log_probs and entropy, temperature, logit scale, softcap,
ignored positions, no-grad reference forwards (a patched reference model; a PEFT policy with the adapter
disabled). The counters see foak's two ops and TRL's kernel: foak serves every call, TRL's kernel none."""

import copy

import peft
import pytest
import torch
import trl.trainer.utils as trl_utils
from trl.kernels.chunked_logprob import ChunkedLogProbFunction

import foak
from foak.integrations.trl import OTHER_MODEL
import foak.ops.linear_cross_entropy as lce_module
import foak.ops.linear_log_probs as llp_module
from foak.models.tiny import tiny_model
from foak.testing import relative_error

OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# what each trainer asks for (trl/trainer/*_trainer.py, add_fused_lm_head(..., outputs=...)); every
# reference model gets the default ("log_probs",)
REQUESTS = {
    "sft": ("log_probs", "entropy", "is_top1"),
    "dpo": ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"),  # the last with use_weighting
    "kto": ("log_probs", "entropy", "mean_logits"),
    "grpo_rloo": ("log_probs", "entropy"),
    "reference": ("log_probs",),
}
# (temperature, logit_scale, softcap)
TRANSFORMS = [(1.0, 1.0, None), (0.7, 1.3, None), (1.3, 0.5, 3.0)]
N = 37  # rows scored in the direct calls
TRL_CHUNK = 128  # TRL's vocabulary tile in the direct calls: 3 tiles over the tiny vocabulary of 301


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of foak's two ops and the forwards of TRL's ChunkedLogProbFunction."""
    counts = {"linear_log_probs": 0, "linear_cross_entropy": 0, "trl": 0}

    def counting(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(llp_module, "linear_log_probs", counting("linear_log_probs", llp_module.linear_log_probs))
    monkeypatch.setattr(lce_module, "linear_cross_entropy",
                        counting("linear_cross_entropy", lce_module.linear_cross_entropy))
    monkeypatch.setattr(ChunkedLogProbFunction, "forward", staticmethod(counting("trl", ChunkedLogProbFunction.forward)))
    return counts


def _head(dtype=torch.float32, bias=False):
    model = tiny_model("llama").to(dtype)
    if bias:  # a head with a bias (nn.Linear's own; TRL passes lm_head.bias)
        model.lm_head.bias = torch.nn.Parameter(0.3 * torch.randn(model.lm_head.out_features).to(dtype))
    report = foak.patch(model, fused_linear_loss=True)
    return model, report


def _inputs(weight, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    # logits ~ 3 (tiny llama's weights are ~0.02): the softcap of 3 bends them
    hidden = (20 * torch.randn(N, weight.shape[1], generator=g)).to(weight.dtype)
    targets = torch.randint(0, weight.shape[0], (N,), generator=g)
    logits = hidden.double() @ weight.double().t() + (bias.double() if bias is not None else 0)
    targets[::2] = logits.argmax(-1)[::2]  # half the rows predicted right: is_top1 is not all False
    return hidden, targets


def _call(function, hidden, weight, bias, targets, transform, outputs, seed=1):
    """function.apply on fresh leaves, then a backward with per-row gradients of log_probs and (when
    returned) entropy, as DPO's and GRPO's losses send. Returns (the five outputs, gradients)."""
    temperature, logit_scale, softcap = transform
    # the head's own parameters (the stand-in recognises them), a fresh hidden leaf
    leaves = [hidden.detach().clone().requires_grad_(), *(t for t in (weight, bias) if t is not None)]
    out = function.apply(leaves[0], leaves[1], leaves[2] if bias is not None else None, targets, temperature,
                         TRL_CHUNK, softcap, logit_scale, outputs)
    g = torch.Generator().manual_seed(seed)
    loss = (out[0] * torch.randn(N, generator=g)).sum()
    if out[1] is not None:
        loss = loss + (out[1] * torch.randn(N, generator=g)).sum()  # GRPO's entropy bonus
    grads = torch.autograd.grad(loss, leaves)
    return [o.detach() if o is not None else None for o in out], grads


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("request_name", list(REQUESTS))
def test_every_request_matches_trls_kernel_in_fp32(calls, request_name, transform):
    outputs = REQUESTS[request_name]
    model, report = _head(bias=transform[2] is not None)
    weight, bias = model.lm_head.weight, model.lm_head.bias
    hidden, targets = _inputs(weight, bias)
    out, grads = _call(trl_utils._ChunkedLogProbFunction, hidden, weight, bias, targets, transform, outputs)
    served_by = "linear_cross_entropy" if request_name == "sft" and transform[2] is None else "linear_log_probs"
    assert calls[served_by] == 1 and calls["trl"] == 0
    ref, ref_grads = _call(ChunkedLogProbFunction, hidden, weight, bias, targets, transform, outputs)
    assert calls["trl"] == 1
    for name, got, want in zip(OUTPUTS, out, ref):
        assert (got is None) == (want is None) == (name not in outputs), name
        if got is None:
            continue
        assert got.shape == want.shape == (N,) and got.dtype == want.dtype, name
        if name == "is_top1":
            assert torch.equal(got, want) and 0 < int(got.sum()) < N
        else:
            assert relative_error(got, want) < 1e-5, (name, relative_error(got, want))
    assert len(grads) == len(ref_grads) == (3 if bias is not None else 2)
    for got, want in zip(grads, ref_grads):
        assert relative_error(got, want) < 1e-5
    assert report.result("llama.fused_linear_loss").notes == "served TRL's fused LM head (1 call)"


@pytest.mark.parametrize("request_name,transform", [("dpo", TRANSFORMS[0]), ("grpo_rloo", TRANSFORMS[2])])
def test_bf16_is_as_close_to_fp32_as_trls_own_kernel(calls, request_name, transform):
    outputs = REQUESTS[request_name]
    model, _ = _head(torch.bfloat16, bias=True)
    weight, bias = model.lm_head.weight, model.lm_head.bias
    hidden, targets = _inputs(weight, bias)
    out, grads = _call(trl_utils._ChunkedLogProbFunction, hidden, weight, bias, targets, transform, outputs)
    trl_out, trl_grads = _call(ChunkedLogProbFunction, hidden, weight, bias, targets, transform, outputs)
    fp32_out, fp32_grads = _call(ChunkedLogProbFunction, hidden.float(), *(t.detach().float().requires_grad_()
                                 for t in (weight, bias)), targets, transform, outputs)
    assert calls["linear_log_probs"] == 1 and calls["trl"] == 2
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    for name, got, trl, want in [*zip(OUTPUTS, out, trl_out, fp32_out),
                                 *zip(("d_hidden", "d_weight", "d_bias"), grads, trl_grads, fp32_grads)]:
        if got is None or name == "is_top1":
            continue
        foak_error, trl_error = relative_error(got, want), relative_error(trl, want)
        assert foak_error <= 2 * trl_error, (name, foak_error, trl_error)


def _batch(vocab):
    """Two sequences of 11 tokens: the second padded (attention mask 0, label -100) after 7; prompt tokens
    unlabelled (-100) in both, as DPO/GRPO label only the completion."""
    g = torch.Generator().manual_seed(4)
    input_ids = torch.randint(0, vocab, (2, 11), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0
    labels = input_ids.clone()
    labels[:, :3] = -100
    labels[1, 7:] = -100
    return dict(input_ids=input_ids, attention_mask=attention_mask), labels


@pytest.mark.parametrize("model_type,compact", [("llama", False), ("gemma2", True), ("granite", False)])
def test_fused_lm_head_of_a_patched_model_matches_trl_on_the_unpatched_twin(calls, monkeypatch, model_type,
                                                                              compact):
    # gemma2: final_logit_softcapping; granite: logits_scaling (TRL's logit_scale = 1 / logits_scaling);
    # compact: TRL's CUDA path, only the labelled positions scored (CPU: every position, targets clamped)
    if compact:
        monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    twin = tiny_model(model_type)
    model = copy.deepcopy(twin)
    report = foak.patch(model, fused_linear_loss=True)
    rule = next(r for r in report.results if r.rule_id.endswith("fused_linear_loss"))
    results = []
    for m in (model, twin):
        trl_utils.add_fused_lm_head(m, temperature=0.7, outputs=OUTPUTS)
        inputs, labels = _batch(m.config.vocab_size)
        out = m(**inputs, labels=labels, fused_lm_head=True)
        g = torch.Generator().manual_seed(2)
        (out.log_probs * torch.randn(out.log_probs.shape, generator=g)).sum().add(
            (out.entropy * torch.randn(out.entropy.shape, generator=g)).sum()).backward()
        results.append((out, {n: p.grad for n, p in m.named_parameters()}))
        if m is model:
            assert calls == {"linear_log_probs": 1, "linear_cross_entropy": 0, "trl": 0}
    (out, grads), (ref, ref_grads) = results
    assert calls["trl"] == 1
    assert model.config.get_text_config().final_logit_softcapping if model_type == "gemma2" else True
    mask = labels[:, 1:] != -100  # position s scores token s + 1
    assert torch.equal(out.label_mask, mask)
    for name in OUTPUTS:
        got, want = getattr(out, name), getattr(ref, name)
        assert got.shape == mask.shape and (got[~mask] == 0).all(), name  # ignored positions: 0 / False
        if name == "is_top1":
            assert torch.equal(got, want)
        elif name == "mean_logits":  # ~0 here (logits ~0.5 that cancel): fp32 rounding of the sum, absolutely
            assert (got - want).abs().max() < 1e-6
        else:
            assert relative_error(got, want) < 1e-5, name
    assert grads.keys() == ref_grads.keys()
    for name, want in ref_grads.items():
        assert relative_error(grads[name], want) < 1e-5, name
    # the unpatched twin ran TRL's kernel while the patched model lives: counted in its row
    assert rule.notes == "served TRL's fused LM head (1 call); TRL's own kernel ran 1 call: " + OTHER_MODEL


def test_a_head_copy_peft_makes_after_patching_is_served_and_trained(calls):
    # foak.patch, then TRL's head, then PEFT with modules_to_save=["lm_head"] (DPOTrainer(peft_config=...) does
    # this): the causal LM's lm_head becomes PEFT's wrapper and TRL passes the trainable copy's weight. Before the
    # fix foak did not recognise that weight: TRL's kernel ran every policy call, reported as "a model foak did
    # not patch"
    twin = tiny_model("llama")
    policy = copy.deepcopy(twin)
    report = foak.patch(policy, fused_linear_loss=True)
    models = []
    for m in (policy, twin):
        trl_utils.add_fused_lm_head(m, outputs=REQUESTS["dpo"])
        torch.manual_seed(5)
        models.append(peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False,
                                                             modules_to_save=["lm_head"])))
    inputs, labels = _batch(policy.config.vocab_size)
    results = []
    for m in models:
        out = m(**inputs, labels=labels, fused_lm_head=True)
        (out.log_probs * torch.arange(out.log_probs.numel()).view_as(out.log_probs)).sum().backward()
        with torch.no_grad(), trl_utils.use_adapter(m, adapter_name=None):  # the reference: the original head
            ref = m(**inputs, labels=labels, fused_lm_head=True)
        copy_weight = m.base_model.model.lm_head.modules_to_save["default"].weight
        results.append((out.log_probs.detach(), ref.log_probs, copy_weight.grad))
        if m is models[0]:
            assert calls == {"linear_log_probs": 2, "linear_cross_entropy": 0, "trl": 0}
    (log_probs, ref_log_probs, grad), (want, want_ref, want_grad) = results
    assert grad is not None and want_grad is not None and want_grad.abs().max() > 0
    for got, expected in ((log_probs, want), (ref_log_probs, want_ref), (grad, want_grad)):
        assert relative_error(got, expected) < 1e-5
    assert report.result("llama.fused_linear_loss").notes == (
        "served TRL's fused LM head (2 calls); TRL's own kernel ran 2 calls: " + OTHER_MODEL)  # (the twin's)


def _count_saved(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        result = fn()
    return result, len(saved)


@pytest.mark.parametrize("reference", ["patched model", "peft adapter disabled"])
def test_reference_forward_is_served_in_no_grad_mode_and_saves_nothing(calls, reference):
    policy = tiny_model("llama")
    twin = copy.deepcopy(policy)  # TRL's kernel on the unpatched model: the expected log-probs
    report = foak.patch(policy, fused_linear_loss=True)
    rule = report.result("llama.fused_linear_loss")
    if reference == "patched model":  # DPO/KTO/GRPO/RLOO's ref_model, patched by the user
        trl_utils.add_fused_lm_head(policy)
        ref_model = policy
    else:  # a LoRA policy: TRL adds the head to the base model, the reference is the adapter disabled
        trl_utils.add_fused_lm_head(policy, outputs=REQUESTS["dpo"])
        torch.manual_seed(5)
        ref_model = peft.get_peft_model(policy, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                 init_lora_weights=False))
    trl_utils.add_fused_lm_head(twin)
    inputs, labels = _batch(policy.config.vocab_size)

    def reference_forward():
        with torch.no_grad():
            if isinstance(ref_model, peft.PeftModel):
                with trl_utils.use_adapter(ref_model, adapter_name=None):
                    return ref_model(**inputs, labels=labels, fused_lm_head=True)
            return ref_model(**inputs, labels=labels, fused_lm_head=True)

    out, saved = _count_saved(reference_forward)
    assert saved == 0 and not out.log_probs.requires_grad
    assert calls == {"linear_log_probs": 1, "linear_cross_entropy": 0, "trl": 0}
    with torch.no_grad():
        want = twin(**inputs, labels=labels, fused_lm_head=True).log_probs
    assert relative_error(out.log_probs, want) < 1e-5
    if reference == "peft adapter disabled":  # the adapter is live again: the policy's log-probs differ
        with torch.no_grad():
            policy_out = ref_model(**inputs, labels=labels, fused_lm_head=True)
        assert relative_error(policy_out.log_probs, want) > 1e-3 and policy_out.mean_logits is not None
    served = 2 if reference == "peft adapter disabled" else 1
    assert calls["trl"] == 1 and rule.notes == (f"served TRL's fused LM head ({served} call{'s' * (served > 1)}); "
                                                "TRL's own kernel ran 1 call: " + OTHER_MODEL)  # (the twin)


def test_training_forward_saves_no_logits(calls):
    model, _ = _head()
    weight = model.lm_head.weight
    hidden, targets = _inputs(weight, None)
    hidden.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        trl_utils._ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, TRL_CHUNK, None, 1.0,
                                               REQUESTS["dpo"])
    assert calls["linear_log_probs"] == 1
    # the inputs (hidden, weight, targets) and per-row statistics (row max and log-sum, entropy): no logits
    assert sorted(saved) == sorted([(N, 64), (301, 64), (N,), (2, N), (N,)])


def test_autocast_and_cast_lm_head_to_fp32(calls):
    # TRL's default bf16 training: bf16 autocast over fp32 weights (the GEMMs in bf16, fp32 gradients)
    model, _ = _head(bias=True)
    weight, bias = model.lm_head.weight, model.lm_head.bias
    hidden, targets = _inputs(weight, bias)
    transform, outputs = TRANSFORMS[1], REQUESTS["dpo"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads = _call(trl_utils._ChunkedLogProbFunction, hidden, weight, bias, targets, transform, outputs)
        trl_out, trl_grads = _call(ChunkedLogProbFunction, hidden, weight, bias, targets, transform, outputs)
    fp32_out, fp32_grads = _call(ChunkedLogProbFunction, hidden, weight, bias, targets, transform, outputs)
    assert calls["linear_log_probs"] == 1 and calls["trl"] == 2
    assert [g.dtype for g in grads] == [torch.float32] * 3
    for name, got, trl, want in [*zip(OUTPUTS[:4], out, trl_out, fp32_out),
                                 *zip(("d_hidden", "d_weight", "d_bias"), grads, trl_grads, fp32_grads)]:
        foak_error, trl_error = relative_error(got, want), relative_error(trl, want)
        assert 0 < foak_error <= 2 * trl_error, (name, foak_error, trl_error)
    # cast_lm_head_to_fp32 over a bf16 head: fp32 hidden states, bf16 weights, autocast off: fp32 GEMMs
    model16, _ = _head(torch.bfloat16, bias=True)
    weight, bias = model16.lm_head.weight, model16.lm_head.bias
    out, grads = _call(trl_utils._ChunkedLogProbFunction, hidden, weight, bias, targets, transform, outputs)
    ref, ref_grads = _call(ChunkedLogProbFunction, hidden, weight, bias, targets, transform, outputs)
    assert calls["linear_log_probs"] == 2 and calls["trl"] == 3
    assert [g.dtype for g in grads] == [torch.float32, torch.bfloat16, torch.bfloat16]
    for name, got, want in zip(OUTPUTS, out, ref):
        assert torch.equal(got, want) if name == "is_top1" else relative_error(got, want) < 1e-5, name
    assert relative_error(grads[0], ref_grads[0]) < 1e-5
    for got, want in zip(grads[1:], ref_grads[1:]):  # the bf16 weight and bias gradients: fp32 ones, rounded
        assert relative_error(got, want) < 2e-3


def test_a_trained_fsdp2_heads_gathered_copy_is_recognised_through_autograd(calls, monkeypatch):
    # FSDP2 keeps lm_head.weight sharded (a DTensor) outside the head's forward; TRL scores with
    # weight.full_tensor(), a new tensor whose graph leads back to the parameter (a clone stands in for it)
    model, report = _head()
    weight = model.lm_head.weight
    monkeypatch.setattr("foak.integrations.trl._sharded", lambda w: w is weight)
    hidden, targets = _inputs(weight, None)
    transform, outputs = TRANSFORMS[1], REQUESTS["grpo_rloo"]

    def gathered_call(function):
        h = hidden.clone().requires_grad_()
        weight.grad = None
        out = function.apply(h, weight.clone(), None, targets, *transform[:1], TRL_CHUNK, None, transform[1],
                             outputs)
        (out[0] * torch.linspace(-1, 1, N) + out[1] * torch.linspace(1, 2, N)).sum().backward()
        return out[0].detach(), out[1].detach(), h.grad, weight.grad.clone()

    got = gathered_call(trl_utils._ChunkedLogProbFunction)
    assert calls == {"linear_log_probs": 1, "linear_cross_entropy": 0, "trl": 0}
    want = gathered_call(ChunkedLogProbFunction)
    for a, b in zip(got, want):
        assert relative_error(a, b) < 1e-5
    assert report.result("llama.fused_linear_loss").notes == "served TRL's fused LM head (1 call)"


# ---- FSDP2 on two gloo CPU processes ---------------------------------------------------------------------------
FSDP_CASES = ("head unit", "frozen head unit", "accelerate layout")


def _fsdp_step(model, case):
    """add_fused_lm_head, a forward of the same batch on every rank, a backward through log_probs and
    entropy; returns (log_probs, entropy, {parameter: full gradient})."""
    trl_utils.add_fused_lm_head(model, temperature=0.7, outputs=REQUESTS["grpo_rloo"])
    inputs, labels = _batch(model.config.vocab_size)
    out = model(**inputs, labels=labels, fused_lm_head=True)
    g = torch.Generator().manual_seed(2)
    (out.log_probs * torch.randn(out.log_probs.shape, generator=g)).sum().add(
        (out.entropy * torch.randn(out.entropy.shape, generator=g)).sum()).backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in model.named_parameters() if p.grad is not None}
    return out.log_probs.detach(), out.entropy.detach(), grads


def _fsdp_model(case, patched):
    model = tiny_model("llama", seed=1)
    if case == "frozen head unit":  # LoRA-style: the head takes no gradient
        model.lm_head.weight.requires_grad_(False)
    report = foak.patch(model, fused_linear_loss=True) if patched else None
    return model, report


def _fsdp_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from foak.integrations.accelerate import shard_model

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for case in FSDP_CASES:
        model, report = _fsdp_model(case, patched=True)
        if case == "accelerate layout":  # [final norm, lm_head] one unit: the backbone's norm gathers the head
            shard_model(model, mesh=mesh, reshard_after_forward=True, head_reshard_after_forward=True)
        else:  # the head a unit of its own: TRL reads a DTensor and scores weight.full_tensor()
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model.lm_head, mesh=mesh)
            fully_shard(model, mesh=mesh)
            assert isinstance(model.lm_head.weight, DTensor)
        results[case] = (*_fsdp_step(model, case), report.result("llama.fused_linear_loss").notes)
    return results


def test_fsdp2_sharded_heads(tmp_path):
    from distributed_utils import run_ranks

    ranks = run_ranks(_fsdp_rank, 2, tmp_path, timeout_s=240)
    for case in FSDP_CASES:
        want = _fsdp_step(_fsdp_model(case, patched=False)[0], case)
        for rank in ranks:
            *got, notes = rank[case]
            assert relative_error(got[0], want[0]) < 1e-5 and relative_error(got[1], want[1]) < 1e-5, case
            assert got[2].keys() == want[2].keys() and ("lm_head.weight" in want[2]) == (case != "frozen head unit")
            for name, grad in want[2].items():
                assert relative_error(got[2][name], grad) < 1e-5, (case, name)
            if case == "frozen head unit":  # nothing links TRL's gathered copy to this model's head
                assert notes == ("TRL's own kernel ran 1 call: lm_head sharded as a DTensor (FSDP2) and gathered "
                                 "without a gradient (a frozen head or a no-grad forward): foak cannot tell TRL's "
                                 "gathered copy from another model's head"), notes
            else:
                assert notes == "served TRL's fused LM head (1 call)", (case, notes)


def test_a_fast_loss_model_says_that_trls_fused_head_ran_trls_kernel(calls):
    # fms-acceleration's sample stanzas ask for fast_loss (foak's cross_entropy on the logits); TRL 1.x's SFTTrainer
    # (fms-hf-tuning's trainer) calls the fused LM head, which never builds the logits nor calls loss_function.
    # Before the fix the fast_loss row claimed its module and said nothing: a loss kernel reported that never ran
    model = tiny_model("llama")
    report = foak.patch(model, fast_loss=True)
    row = report.result("llama.loss")
    assert row.modules == 1 and row.notes == ""
    inputs, labels = _batch(model.config.vocab_size)
    model(**inputs, labels=labels).loss.backward()  # the model's own loss: foak's cross_entropy
    assert row.notes == "foak cross_entropy ran 1 call"
    trl_utils.add_fused_lm_head(model, outputs=REQUESTS["sft"])
    with pytest.warns(UserWarning, match="TRL's own kernel runs: TRL's fused LM head computes the loss"):
        model(**inputs, labels=labels, fused_lm_head=True)
    assert calls == {"linear_log_probs": 0, "linear_cross_entropy": 0, "trl": 1}
    assert row.notes == ("foak cross_entropy ran 1 call; TRL's own kernel ran 1 call: TRL's fused LM head computes the "
                         "loss from the hidden states and never calls the model's loss_function, so fast_loss's "
                         "cross_entropy did not run; set fused_linear_loss (instead of fast_loss) for foak to serve it")


def test_an_entropy_bonus_on_a_frozen_head_is_learned_after_one_step(calls, monkeypatch):
    # GRPO with entropy_coef != 0 on a LoRA policy: the head is frozen and the entropy is differentiated, so every
    # backward recomputes the logits. The first forward also computed a frozen head's log_probs row gradient (of no
    # use then); the head then knows, and later forwards keep only the row statistics. Gradients as TRL's kernel's.
    recomputes, backward = [], llp_module._backward_op
    monkeypatch.setattr(llp_module, "_backward_op", lambda *a: recomputes.append(1) or backward(*a))
    row_grads, forward = [], llp_module._forward_op
    monkeypatch.setattr(llp_module, "_forward_op", lambda *a: row_grads.append(a[12]) or forward(*a))
    model, report = _head()
    weight = model.lm_head.weight.requires_grad_(False)
    hidden, targets = _inputs(weight, None)
    g = torch.Generator().manual_seed(1)
    d_logp, d_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def step(function):
        h = hidden.detach().clone().requires_grad_()
        out = function.apply(h, weight, None, targets, 0.7, TRL_CHUNK, None, 1.3, REQUESTS["grpo_rloo"])
        return out, torch.autograd.grad((out[0] * d_logp).sum() + (out[1] * d_ent).sum(), h)[0]

    want, want_dh = step(ChunkedLogProbFunction)
    for call in range(3):
        got, dh = step(trl_utils._ChunkedLogProbFunction)
        assert len(recomputes) == call + 1 and row_grads == [True] + [False] * call
        assert relative_error(got[0], want[0]) < 1e-5 and relative_error(got[1], want[1]) < 1e-5
        assert relative_error(dh, want_dh) < 1e-5
    assert "the entropy received a gradient" in report.result("llama.fused_linear_loss").notes
    assert calls["linear_log_probs"] == 3 and calls["trl"] == 1
