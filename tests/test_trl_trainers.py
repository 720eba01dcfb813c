"""foak under TRL's preference and RL trainers: DPO, GRPO (a stub reward, completions from ``generate``), RLOO
and KTO, two optimizer steps each on a tiny Llama (fp32, CPU, foak's torch reference ops), foak-patched policy and
reference model vs the same trainer without foak.

Every one of these trainers scores its policy and its reference model through TRL's fused LM head
(``trl.trainer.utils.add_fused_lm_head``), which foak serves (foak/integrations/trl.py). Each test counts the calls
of TRL's own kernel (``ChunkedLogProbFunction.forward``, whoever calls it: 0 with foak) and the calls foak served
(the fused_linear_loss rows of the policy's and the reference model's PatchReports), and compares every metric the
trainer logged at both steps (loss, rewards, log-probs, KL, entropy, grad_norm, ...) with the run without foak.

The policy is patched before the trainer is built. The reference model is either passed to the trainer (KTO here),
patched with foak.patch before, or the trainer's own (DPO, GRPO, RLOO: TRL loads it from the policy's directory,
where the tiny model is saved once), patched with ``foak.patch(trainer.ref_model)`` once the trainer is built.

Also here (issue 26's step-1 discrepancy): DPO's step 1 with and without foak against a float64 computation of the
same step, in fp32 (both at rounding distance) and under TRL's default bf16 autocast (where they differ by bf16
rounding, foak's log-probs the closer ones), and the module whose output first differs under bf16 autocast."""

import copy
import functools
import gc
import math
import re

import datasets  # pinned in requirements-test.txt with trl: a missing install fails, never skips
import peft
import pytest
import torch
import transformers
import trl
from trl.kernels.chunked_logprob import ChunkedLogProbFunction

import foak
from foak.data import char_tokenizer
from foak.models.tiny import tiny_model
from foak.patching import is_patched

KERNELS = {"fast_rms_layernorm": True, "fast_rope_embeddings": True, "fast_swiglu": True,
           "fused_linear_loss": True}
# wall-clock metrics, never equal between two runs
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
RTOL, ATOL = 1e-5, 1e-6  # fp32; ATOL for metrics that are differences of log-probs (rewards, KL, margins)
SERVED = re.compile(r"served TRL's fused LM head \((\d+) calls?\)")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny Llama and its tokenizer saved once: TRL builds the reference model from the policy's path."""
    path = tmp_path_factory.mktemp("tiny_llama_rl")
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    model.resize_token_embeddings(len(tokenizer))  # every sampled token decodes to a character
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def trl_calls(monkeypatch):
    """Counts the forwards of TRL's own ChunkedLogProbFunction (every caller: TRL's head, foak's fallbacks)."""
    counts = [0]
    forward = ChunkedLogProbFunction.forward

    def counting(*args, **kwargs):
        counts[0] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(ChunkedLogProbFunction, "forward", staticmethod(counting))
    return counts


def _reward(completions, **kwargs):
    """A stub reward with spread inside each group of completions: more vowels, fewer characters."""
    return [sum(c in "aeiou" for c in text) - 0.1 * len(text) for text in completions]


COMMON = dict(max_steps=2, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", report_to="none",
              save_strategy="no", logging_steps=1, bf16=False, seed=3)


def _trainer(name, tiny_dir, out_dir, lora=False, **overrides):
    """(policy, the reference model passed to the trainer or None, build(policy, reference) -> trainer) for
    trainer ``name`` on the tiny Llama saved at tiny_dir (dataset, config and reward built here); ``overrides``:
    config fields. KTO gets a reference model from the caller (patched before the trainer is built); DPO, GRPO and
    RLOO load their own from the policy's directory (or disable the LoRA adapter)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    # LoRA: the reference is the policy with its adapter disabled; non-zero B so that it differs at step 1
    peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                  init_lora_weights=False) if lora else None
    common = dict(output_dir=str(out_dir), **{**COMMON, **overrides})
    if name == "dpo":
        data = {"prompt": ["the cat ", "1 2 3 "], "chosen": ["sees the ball.", "4 5."],
                "rejected": ["likes a red box!", "9 9 9 9."]}
        config = trl.DPOConfig(per_device_train_batch_size=2, dataset_num_proc=None, **common)
        return model, None, lambda m, ref: trl.DPOTrainer(
            model=m, args=config, train_dataset=datasets.Dataset.from_dict(data), processing_class=tokenizer,
            peft_config=peft_config)
    if name == "kto":
        data = {"prompt": ["the cat ", "1 2 3 ", "a dog ", "7 8 "],
                "completion": ["sees the ball.", "4 5.", "is blue 9", "9 9 9."],
                "label": [True, True, False, False]}
        config = trl.KTOConfig(per_device_train_batch_size=4, dataset_num_proc=None, **common)
        ref_model = None if lora else transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
        return model, ref_model, lambda m, ref: trl.KTOTrainer(
            model=m, ref_model=ref, args=config, train_dataset=datasets.Dataset.from_dict(data),
            processing_class=tokenizer, peft_config=peft_config)
    # GRPO / RLOO: 2 prompts x 4 completions of 6 sampled tokens, a KL term (a reference model), temperature != 1
    data = {"prompt": ["the cat ", "1 2 3 "]}
    rl = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=6, beta=0.1, temperature=0.9,
              **common)
    if name == "grpo":
        # the entropy bonus differentiates the fused head's entropy
        config = trl.GRPOConfig(entropy_coef=0.01, **rl)
        trainer_class = trl.GRPOTrainer
    else:
        config = trl.RLOOConfig(**rl)
        trainer_class = trl.RLOOTrainer
    return model, None, lambda m, ref: trainer_class(
        model=m, reward_funcs=_reward, args=config, train_dataset=datasets.Dataset.from_dict(data),
        processing_class=tokenizer, peft_config=peft_config)


def _train(name, tiny_dir, out_dir, use_foak, lora=False, kernels=KERNELS, **overrides):
    """Two steps of trainer ``name``; returns (the logged metrics per step, the trainer, foak's reports)."""
    model, ref_model, build = _trainer(name, tiny_dir, out_dir, lora, **overrides)
    # LoRA: the trainer adds the adapter after foak.patch; fused_lora fuses it on the first forward
    reports = [foak.patch(model, **kernels, **({"fused_lora": True} if lora else {}))] if use_foak else []
    if use_foak and ref_model is not None:  # a reference model the user passes: patched like the policy
        reports.append(foak.patch(ref_model, **kernels))
    trainer = build(model, ref_model)
    if use_foak and ref_model is None and trainer.ref_model is not None:  # the trainer's own: patched once built
        reports.append(foak.patch(trainer.ref_model, **kernels))
    assert is_patched(trainer.model) == use_foak
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    return steps, trainer, reports


def _served(report) -> int:
    match = SERVED.search(report.result("llama.fused_linear_loss").notes)
    return int(match.group(1)) if match else 0


def _assert_same_metrics(steps, ref_steps):
    for step, (logged, ref_logged) in enumerate(zip(steps, ref_steps, strict=True), 1):
        assert logged.keys() == ref_logged.keys()
        for key, ref_value in ref_logged.items():
            if key in TIMINGS or not isinstance(ref_value, (int, float)):
                continue
            value = logged[key]
            assert math.isfinite(value), (step, key)
            assert abs(value - ref_value) <= RTOL * abs(ref_value) + ATOL, (step, key, value, ref_value)


# (trainer, fused-head calls foak serves over 2 steps: policy, reference model)
# DPO: one policy and one reference forward per step over chosen + rejected; KTO: the policy's completions, and the
# reference model's completions and mismatched (KL) pairs; GRPO / RLOO: one policy forward per step on the sampled
# completions and one reference forward for the KL term, and RLOO one more no-grad policy forward for the old
# log-probs (GRPO skips it with one iteration per generation).
CASES = [("dpo", 2, 2), ("kto", 4, 4), ("grpo", 2, 2), ("rloo", 4, 2)]


@pytest.mark.parametrize(("name", "policy_calls", "ref_calls"), CASES)
def test_trainer_steps_with_foak_match_trl_alone(tmp_path, tiny_dir, trl_calls, reference_ops, name, policy_calls,
                                                 ref_calls):
    ref_steps, ref_trainer, _ = _train(name, tiny_dir, tmp_path / "trl", use_foak=False)
    assert trl_calls[0] == policy_calls + ref_calls  # the counter sees every call TRL's head makes
    # the comparison has something to compare: a gradient at each step, and the first step changed the model
    assert all(step["grad_norm"] > 0 for step in ref_steps) and ref_steps[1]["entropy"] != ref_steps[0]["entropy"]
    if name in ("grpo", "rloo"):
        assert all(step["reward_std"] > 0 for step in ref_steps) and ref_steps[1]["kl"] != 0
    trl_calls[0] = 0
    steps, trainer, (report, ref_report) = _train(name, tiny_dir, tmp_path / "foak", use_foak=True)
    assert (_served(report), _served(ref_report)) == (policy_calls, ref_calls)
    assert trl_calls[0] == 0, report  # foak served every output, gradient and model: TRL's kernel never ran
    assert "TRL's own kernel" not in report.result("llama.fused_linear_loss").notes
    _assert_same_metrics(steps, ref_steps)
    del trainer, ref_trainer
    gc.collect()


def test_grpo_steps_with_foaks_head_kernels_match_trl_alone(tmp_path, tiny_dir, trl_calls):
    # the cases above run foak's torch reference ops; here the fused head runs foak's Triton kernels (the interpreter):
    # log-probs and entropy at temperature 0.9, the entropy bonus's gradient, the reference model's no-grad forward
    # (only the head: the other kernels would run in every generated token's forward, seconds each here)
    ref_steps, _, _ = _train("grpo", tiny_dir, tmp_path / "trl", use_foak=False)
    trl_calls[0] = 0
    steps, _, (report, ref_report) = _train("grpo", tiny_dir, tmp_path / "foak", use_foak=True,
                                            kernels={"fused_linear_loss": True})
    row = report.result("llama.fused_linear_loss")
    assert row.backend.startswith("triton") and (_served(report), _served(ref_report), trl_calls[0]) == (2, 2, 0)
    _assert_same_metrics(steps, ref_steps)


def test_dpo_with_a_lora_adapter_and_its_disabled_adapter_as_reference(tmp_path, tiny_dir, trl_calls, reference_ops):
    # no reference model: TRL scores the reference with the adapter disabled, through the policy's own head
    ref_steps, _, _ = _train("dpo", tiny_dir, tmp_path / "trl", use_foak=False, lora=True)
    assert trl_calls[0] == 4
    trl_calls[0] = 0
    steps, trainer, (report,) = _train("dpo", tiny_dir, tmp_path / "foak", use_foak=True, lora=True)
    assert trainer.ref_model is None and isinstance(trainer.model, peft.PeftModel)
    assert _served(report) == 4 and trl_calls[0] == 0, report  # 2 policy + 2 adapter-disabled forwards
    assert report.result("llama.fused_lora").modules > 0  # the adapter TRL added ran through foak's LoRA rules
    assert steps[0]["rewards/margins"] != 0  # init_lora_weights=False: policy and reference differ from step 1
    _assert_same_metrics(steps, ref_steps)


def _dpo_step1_in_fp64(tiny_dir, trainer):
    """DPO's step-1 metrics computed in float64 from the initial model, sequence by sequence without padding: the
    mean summed completion log-probs of the chosen and rejected answers, and the gradient norm of the sigmoid loss
    (at step 1 the reference equals the policy: every log-ratio is 0)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float64)
    beta = trainer.args.beta

    def completion_logp(prompt, completion):
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, :-1]
        logps = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        return logps[len(prompt) - 1:].sum()

    chosen, rejected = [], []
    for row in trainer.train_dataset:
        chosen.append(completion_logp(row["prompt_ids"], row["chosen_ids"]))
        rejected.append(completion_logp(row["prompt_ids"], row["rejected_ids"]))
    chosen, rejected = torch.stack(chosen), torch.stack(rejected)
    margin = beta * ((chosen - chosen.detach()) - (rejected - rejected.detach()))
    torch.nn.functional.logsigmoid(margin).neg().mean().backward()
    grad_norm = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm()
    return {"logps/chosen": chosen.mean().item(), "logps/rejected": rejected.mean().item(),
            "grad_norm": grad_norm.item()}


def test_dpo_step_one_with_foak_and_without_both_agree_with_float64(tmp_path, tiny_dir, reference_ops):
    # issue 26 reported foak's step-1 DPO logps 8e-6 / 4e-5 and grad_norm 5e-5 (relative) away from TRL's without
    # foak (not reproduced at 76a3f2c: bit-identical in every setting tried). Both runs must sit at fp32 rounding
    # distance from the float64 computation of the same step.
    ref_steps, trainer, _ = _train("dpo", tiny_dir, tmp_path / "trl", use_foak=False)
    steps, _, _ = _train("dpo", tiny_dir, tmp_path / "foak", use_foak=True)
    exact = _dpo_step1_in_fp64(tiny_dir, trainer)
    # measured here vs float64: logps 5.9e-8 and 2.3e-8 (both runs), grad_norm 2.5e-8 (TRL) and 7.6e-8 (foak)
    tolerance = {"logps/chosen": 1e-6, "logps/rejected": 1e-6, "grad_norm": 5e-6}
    for key, want in exact.items():
        for run in (ref_steps, steps):
            assert abs(run[0][key] - want) <= tolerance[key] * abs(want), (key, run[0][key], want)


def test_dpo_step_one_under_bf16_autocast_foak_is_as_close_to_float64_as_trl(tmp_path, tiny_dir, reference_ops):
    # What issue 26 saw: TRL's default bf16=True (on the CPU with use_cpu=True) is bf16 autocast over these fp32
    # weights, not fp32. foak's SwiGLU computes act(g) * u in fp32 and rounds once to bf16 (HF rounds silu(g) to
    # bf16, then the product); its RoPE backward works in fp32: the runs differ by bf16 rounding (~1e-5 in the logps,
    # ~1e-4 in grad_norm). foak's log-probs are closer to the float64 step than TRL's own (measured here: TRL
    # 3.6e-5 / 2.7e-5, foak 1.7e-5 / 1.0e-5); the gradient norm is bf16 noise for both (TRL 1.4e-4, foak 2.1e-4).
    bf16 = dict(bf16=True, use_cpu=True)
    ref_steps, trainer, _ = _train("dpo", tiny_dir, tmp_path / "trl", use_foak=False, **bf16)
    steps, _, _ = _train("dpo", tiny_dir, tmp_path / "foak", use_foak=True, **bf16)
    exact = _dpo_step1_in_fp64(tiny_dir, trainer)
    errors = {key: (abs(ref_steps[0][key] - want) / abs(want), abs(steps[0][key] - want) / abs(want))
              for key, want in exact.items()}
    for key in ("logps/chosen", "logps/rejected"):
        trl_error, foak_error = errors[key]
        assert 0 < trl_error <= 1e-4 and foak_error <= 1.5 * trl_error, (key, errors)
    assert max(errors["grad_norm"]) <= 1e-3, errors


def test_under_bf16_autocast_the_gated_mlp_is_the_first_output_that_differs_and_foaks_is_closer_to_float64(
        reference_ops):
    # the mechanism behind the test above, module by module (one forward of the tiny Llama): under bf16 autocast over
    # fp32 weights the norms' and attention's outputs (RoPE included) are bit-identical with and without foak; the
    # first output that differs is layer 0's gated MLP, on bit-identical inputs, and foak's is closer to float64
    tokenizer = char_tokenizer()
    ids = torch.tensor([tokenizer("the cat sees the ball, 1 2 3 4.")["input_ids"]])
    hf = tiny_model("llama")
    exact, patched = copy.deepcopy(hf).double(), copy.deepcopy(hf)
    foak.patch(patched, **KERNELS)
    parts = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")  # (no hook inside the MLP: a hooked
    names = [f"model.layers.{i}.{part}" for i in range(2) for part in parts]   # down_proj changes foak's path)

    def outputs(model, autocast):
        out, modules = {}, dict(model.named_modules())

        def keep(module, args, result, name):
            out.setdefault(name, (result[0] if isinstance(result, tuple) else result).double())  # returns None

        hooks = [modules[name].register_forward_hook(functools.partial(keep, name=name)) for name in names]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=ids)
        for hook in hooks:
            hook.remove()
        return out

    hf_out, foak_out, exact_out = outputs(hf, True), outputs(patched, True), outputs(exact, False)
    first = next(name for name in names if not torch.equal(hf_out[name], foak_out[name]))
    assert first == "model.layers.0.mlp"
    error = lambda out: ((out[first] - exact_out[first]).norm() / exact_out[first].norm()).item()
    assert 0 < error(foak_out) < error(hf_out) < 2e-2  # measured: foak 5.2e-3, HF 5.5e-3 (one bf16 rounding fewer)


@pytest.mark.parametrize("order", ["precompute_ref_log_probs", "patched after the trainer is built"])
def test_dpo_orders_users_take_are_served(tmp_path, tiny_dir, trl_calls, reference_ops, order):
    # precompute_ref_log_probs=True (full fine-tuning): no reference model; TRL scores the dataset once with the
    # policy before training, under no_grad (1 call), then 2 policy calls. "patched after": foak.patch(trainer.model)
    # once the trainer exists, so foak's fused_linear_loss forward wraps TRL's fused forward (and the same for
    # trainer.ref_model, as docs/trl.md advises)
    overrides = {"precompute_ref_log_probs": True} if order == "precompute_ref_log_probs" else {}
    ref_steps, _, _ = _train("dpo", tiny_dir, tmp_path / "trl", use_foak=False, **overrides)
    trl_calls[0] = 0
    if overrides:
        steps, trainer, reports = _train("dpo", tiny_dir, tmp_path / "foak", use_foak=True, **overrides)
        assert trainer.ref_model is None and [_served(r) for r in reports] == [3]
    else:
        model, _, build = _trainer("dpo", tiny_dir, tmp_path / "foak")
        trainer = build(model, None)
        reports = [foak.patch(trainer.model, **KERNELS), foak.patch(trainer.ref_model, **KERNELS)]
        trainer.train()
        steps = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
        assert [_served(r) for r in reports] == [2, 2]
    assert trl_calls[0] == 0 and all("TRL's own kernel" not in r.result("llama.fused_linear_loss").notes
                                     for r in reports)
    _assert_same_metrics(steps, ref_steps)
