"""foak under TRL's DistillationTrainer: the student patched by foak.patch, TRL's chunked distillation loss
(``trl.trainer.distillation_trainer._chunked_divergence_loss``) served by foak's linear_jsd
(foak/integrations/trl_distill.py). Counts foak's calls and TRL's own kernel's (ChunkedDivergenceFunction) and
compares TRL's logged loss, grad_norm and entropy with TRL on the unpatched student."""

import gc
import importlib
import inspect
import sys

import datasets  # pinned in requirements-test.txt with trl: a missing install fails, never skips
import peft
import pytest
import torch
import trl
import trl.trainer.distillation_trainer as trl_distill
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

import foak
import foak.integrations.trl_distill as foak_distill
import foak.ops.linear_jsd as jsd_module
from foak.data import char_tokenizer
from foak.models.tiny import model_from_config, tiny_config, tiny_model

TRL_LOSS = trl_distill._chunked_divergence_loss
PROMPTS = ["the cat sees", "1 2 3 4", "seven small", "a dog likes"]
ROW = "llama.fused_linear_loss"


@pytest.fixture
def calls(monkeypatch):
    """Counts foak's linear_jsd calls and the forwards of TRL's own ChunkedDivergenceFunction."""
    counts = {"foak": 0, "trl": 0}
    foak_jsd, trl_forward = jsd_module.linear_jsd, ChunkedDivergenceFunction.forward

    def counting_foak(*args, **kwargs):
        counts["foak"] += 1
        return foak_jsd(*args, **kwargs)

    def counting_trl(*args, **kwargs):
        counts["trl"] += 1
        return trl_forward(*args, **kwargs)

    monkeypatch.setattr(jsd_module, "linear_jsd", counting_foak)
    monkeypatch.setattr(ChunkedDivergenceFunction, "forward", staticmethod(counting_trl))
    return counts


def _models(tokenizer):
    """A tiny Llama student and a narrower tiny Llama teacher with a sharper head (the divergence is O(1))."""
    student = tiny_model("llama", seed=0)
    student.resize_token_embeddings(len(tokenizer))
    torch.manual_seed(1)
    config = tiny_config("llama")
    config.hidden_size, config.intermediate_size, config.head_dim = 32, 48, 8
    teacher = model_from_config(config).float()
    teacher.resize_token_embeddings(len(tokenizer))
    with torch.no_grad():
        teacher.lm_head.weight.mul_(40.0)
    return student, teacher


def _distill(tmp_path, patch, beta, kernels=None, checkpointing=False, lora=False):
    """Two SGD steps of DistillationTrainer; returns (TRL's log history, foak's report or None). ``lora``: TRL
    wraps the (patched) student with a LoRA peft_config; "head": one that also trains a copy of the lm_head
    (modules_to_save)."""
    tokenizer = char_tokenizer()
    tokenizer.padding_side = "left"
    student, teacher = _models(tokenizer)
    report = foak.patch(student, **(kernels or {})) if patch else None
    config = trl.DistillationConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", report_to="none", save_strategy="no", seed=3, logging_steps=1,
        bf16=False, gradient_checkpointing=checkpointing, max_completion_length=6, beta=beta, temperature=0.9,
        generation_kwargs={"do_sample": False})  # greedy: both runs score the same completions
    lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                  init_lora_weights=False,
                                  modules_to_save=["lm_head"] if lora == "head" else None) if lora else None
    torch.manual_seed(5)
    trainer = trl.DistillationTrainer(model=student, teacher_model=teacher, args=config,
                                      train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
                                      processing_class=tokenizer, peft_config=lora_config)
    trainer.train()
    return [row for row in trainer.state.log_history if "loss" in row], report


# beta 0.5 with TRL's default gradient checkpointing; a LoRA student (peft_config given to the trainer); one whose
# lm_head PEFT copies after foak.patch (modules_to_save: TRL passes the copy's weight, which foak once did not
# recognise: TRL's loss ran and the row said nothing)
@pytest.mark.parametrize("beta, checkpointing, lora", [(0.0, False, False), (0.5, True, False), (1.0, False, False),
                                                       (0.5, False, True), (0.5, False, "head")],
                         ids=["fkl", "jsd-ckpt", "rkl", "jsd-lora", "jsd-lora-head-copy"])
def test_distillation_trainer_runs_foaks_loss_and_logs_what_trl_logs(tmp_path, calls, beta, checkpointing, lora):
    foak.set_backend("reference")
    try:
        ref, _ = _distill(tmp_path / "ref", False, beta, checkpointing=checkpointing, lora=lora)
        assert calls == {"foak": 0, "trl": 2}  # the counters see TRL's calls
        logs, report = _distill(tmp_path / "foak", True, beta, checkpointing=checkpointing, lora=lora)
    finally:
        foak.set_backend(None)
    assert calls == {"foak": 2, "trl": 2}  # foak served both steps, TRL's kernel ran no more
    assert "served TRL's distillation loss (2 calls)" in report.result(ROW).notes
    assert "TRL's own" not in report.result(ROW).notes
    assert len(logs) == len(ref) == 2
    for row, ref_row in zip(logs, ref):
        assert row["num_tokens"] == ref_row["num_tokens"]
        assert ref_row["loss"] > 0.1  # a divergence worth comparing
        for key in ("loss", "grad_norm", "entropy"):
            assert abs(row[key] - ref_row[key]) <= 1e-5 * abs(ref_row[key]), (key, row[key], ref_row[key])


def test_distillation_trainer_on_foaks_kernel(tmp_path, calls):
    # the Triton kernel (interpreter) serving the trainer; only the loss rule, so the step stays quick here
    ref, _ = _distill(tmp_path / "ref", False, 0.5)
    logs, report = _distill(tmp_path / "foak", True, 0.5, kernels={"fused_linear_loss": True})
    assert calls == {"foak": 2, "trl": 2}
    assert "served TRL's distillation loss (2 calls)" in report.result(ROW).notes
    for row, ref_row in zip(logs, ref):
        for key in ("loss", "grad_norm", "entropy"):
            assert abs(row[key] - ref_row[key]) <= 1e-5 * abs(ref_row[key]), (key, row[key], ref_row[key])


def _loss_arguments(student, teacher, n=5, dtype=torch.float32):
    torch.manual_seed(0)
    hs = torch.randn(1, n, student.config.hidden_size, dtype=dtype, requires_grad=True)
    ht = torch.randn(1, n, teacher.config.hidden_size)
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    return dict(student_hidden_states=hs, teacher_hidden_states=ht, student_lm_head_weight=student.lm_head.weight,
                teacher_lm_head_weight=teacher.lm_head.weight, completion_mask=mask, beta=0.5, temperature=1.2,
                student_final_logit_softcapping=20.0)


def test_stand_in_computes_what_trl_computes_and_hands_the_rest_to_trl(calls):
    student, teacher = _models(char_tokenizer())
    report = foak.patch(student, fused_linear_loss=True)
    args = _loss_arguments(student, teacher)
    assert isinstance(trl_distill._chunked_divergence_loss, foak_distill._FoakDivergenceLoss)
    loss, entropy_sum, n_valid = trl_distill._chunked_divergence_loss(**args)
    ref_loss, ref_entropy_sum, ref_n = TRL_LOSS(**args)
    assert calls == {"foak": 1, "trl": 1} and int(n_valid) == int(ref_n) == 3
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    assert abs(entropy_sum.item() - ref_entropy_sum.item()) <= 1e-5 * ref_entropy_sum.item()
    grad = torch.autograd.grad(loss, args["student_hidden_states"])[0]
    ref_grad = torch.autograd.grad(ref_loss, args["student_hidden_states"])[0]
    assert (grad - ref_grad).abs().max() <= 1e-5 * ref_grad.abs().max()
    # what foak cannot express goes to TRL, counted in the row with the reason
    with pytest.warns(UserWarning, match="TRL's own distillation loss runs"):
        hidden = args["student_hidden_states"].double()
        trl_distill._chunked_divergence_loss(**{**args, "student_hidden_states": hidden})
    assert calls == {"foak": 1, "trl": 2}
    assert ("TRL's own distillation loss ran 1 call: student: torch.float64 hidden states and a torch.float32 "
            "lm_head outside autocast") in report.result(ROW).notes
    # a newer TRL: an argument foak does not know, or callers passing what the loss does not take
    def newer_trl_loss(*a, new_option=None, **k):
        return TRL_LOSS(*a, **k)

    newer_trl_loss.__signature__ = inspect.signature(TRL_LOSS).replace(parameters=[
        *inspect.signature(TRL_LOSS).parameters.values(),
        inspect.Parameter("new_option", inspect.Parameter.KEYWORD_ONLY, default=None)])
    with pytest.warns(UserWarning):
        foak_distill._FoakDivergenceLoss(newer_trl_loss)(**args, new_option=3)
    with pytest.raises(TypeError), pytest.warns(UserWarning):
        trl_distill._chunked_divergence_loss(**args, unknown_option=3)  # TRL's own raises
    notes = report.result(ROW).notes
    assert "TRL's own distillation loss ran 1 call: arguments foak does not know: ['new_option']" in notes
    assert "arguments foak cannot bind to TRL's loss (got an unexpected keyword argument 'unknown_option')" in notes
    assert calls == {"foak": 1, "trl": 3}
    # a student foak did not patch (here: the teacher as the student) gets TRL's function, uncounted
    trl_distill._chunked_divergence_loss(**{**args, "student_lm_head_weight": teacher.lm_head.weight,
                                            "student_hidden_states": torch.randn(1, 5, 32)})
    assert calls == {"foak": 1, "trl": 4}
    foak.restore(student)


def test_stand_in_is_installed_while_a_patched_model_exists_and_restored_after():
    gc.collect()  # patched models of earlier tests (a patched model is in a reference cycle)
    assert trl_distill._chunked_divergence_loss is TRL_LOSS
    first, second = tiny_model("llama"), tiny_model("llama")
    foak.patch(first, fused_linear_loss=True)
    foak.patch(second, fused_linear_loss=True)
    stand_in = trl_distill._chunked_divergence_loss
    assert isinstance(stand_in, foak_distill._FoakDivergenceLoss)
    foak.restore(first)
    assert trl_distill._chunked_divergence_loss is stand_in
    del second  # garbage-collected without a restore
    gc.collect()
    assert trl_distill._chunked_divergence_loss is TRL_LOSS
    foak.patch(first, fast_rms_layernorm=True)  # a config without fused_linear_loss installs nothing
    assert trl_distill._chunked_divergence_loss is TRL_LOSS


def test_trl_distillation_imported_after_patching_is_served(monkeypatch):
    gc.collect()
    # as if TRL's distillation module had not been imported yet (the module object the tests hold stays untouched)
    monkeypatch.delitem(sys.modules, foak_distill._MODULE)
    monkeypatch.setattr(trl.trainer, "distillation_trainer", trl_distill)
    model = tiny_model("llama")
    foak.patch(model, fused_linear_loss=True)
    assert trl_distill._chunked_divergence_loss is TRL_LOSS
    imported = importlib.import_module(foak_distill._MODULE)  # e.g. `from trl import DistillationTrainer` now
    assert imported is not trl_distill
    assert isinstance(imported._chunked_divergence_loss, foak_distill._FoakDivergenceLoss)
    assert not any(isinstance(f, foak_distill._ImportHook) for f in sys.meta_path)
    foak.restore(model)
    assert not isinstance(imported._chunked_divergence_loss, foak_distill._FoakDivergenceLoss)


def test_stand_in_bf16_error_is_within_twice_trls_own(calls):
    """bf16 student and teacher: foak's error against fp64 on the same bf16 values is at most twice TRL's own
    (loss, entropy, gradients of the hidden states and of the lm_head weight)."""
    from test_linear_jsd import fp64_reference

    from foak.testing import relative_error

    student, teacher = (m.to(torch.bfloat16) for m in _models(char_tokenizer()))
    foak.patch(student, fused_linear_loss=True)
    gen = torch.Generator().manual_seed(3)
    n = 24
    hs = torch.randn(2, n, student.config.hidden_size, generator=gen).bfloat16()
    ht = torch.randn(2, n, teacher.config.hidden_size, generator=gen).bfloat16()
    mask = (torch.rand(2, n, generator=gen) > 0.2).long()
    options = dict(beta=0.5, temperature=1.2, student_final_logit_softcapping=20.0)
    ref_inputs = {"student_hidden": hs.reshape(-1, hs.shape[-1]), "student_weight": student.lm_head.weight.detach(),
                  "student_bias": None, "teacher_hidden": ht.reshape(-1, ht.shape[-1]),
                  "teacher_weight": teacher.lm_head.weight.detach(), "teacher_bias": None}
    ref_loss, ref_entropy, _, leaves = fp64_reference(ref_inputs, mask.reshape(-1), 0.5, temperature=1.2,
                                                      student_softcap=20.0)
    ref = [ref_loss, ref_entropy * mask.sum(), *torch.autograd.grad(ref_loss, [leaves["student_hidden"],
                                                                               leaves["student_weight"]])]
    errors = {}
    for name, loss_fn in (("foak", trl_distill._chunked_divergence_loss), ("trl", TRL_LOSS)):
        hidden = hs.clone().requires_grad_()
        loss, entropy_sum, _ = loss_fn(hidden, ht, student.lm_head.weight, teacher.lm_head.weight, mask, **options)
        loss.backward()
        got = [loss, entropy_sum, hidden.grad.reshape(-1, hidden.shape[-1]), student.lm_head.weight.grad]
        errors[name] = [relative_error(g, r) for g, r in zip(got, ref)]
        student.zero_grad(set_to_none=True)
    assert calls == {"foak": 1, "trl": 1}
    for what, foak_error, trl_error in zip(("loss", "entropy", "d_hidden", "d_weight"), errors["foak"],
                                           errors["trl"]):
        assert foak_error <= max(2 * trl_error, 1e-6), (what, foak_error, trl_error)
    assert max(errors["trl"][2:]) > 1e-4  # bf16 gradients: TRL's error is bf16-sized, the bound means something
