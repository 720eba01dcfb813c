"""foak in a TRL SFTTrainer script: patched before building the trainer, or through FoakCallback.

TRL 1.x computes the loss through its own fused LM head (``model(**inputs, fused_lm_head=True)`` ->
``trl.trainer.utils._ChunkedLogProbFunction``), past the model's lm_head and loss_function; foak's
fused_linear_loss rule serves that head (foak/integrations/trl.py). These tests count the calls of foak's
linear_cross_entropy and of TRL's own kernel, and compare loss, updates and TRL's logged metrics with TRL
on the unpatched model."""

import gc
import importlib
import sys

import datasets  # pinned in requirements-test.txt with trl: a missing install fails, never skips
import peft
import pytest
import torch
import trl
import trl.trainer.utils as trl_utils
from trl.kernels.chunked_logprob import ChunkedLogProbFunction

import foak
from foak.integrations.trl import OTHER_MODEL
import foak.integrations.trl as foak_trl
import foak.ops.linear_cross_entropy as lce_module
from foak.data import char_tokenizer
from foak.integrations import FoakCallback
from foak.models.tiny import tiny_model
from foak.patching import is_patched
from foak.testing import relative_error

# one step of batch 3 (the interpreter's time is per token: three short texts, of different lengths)
TEXTS = ["the cat sees the ball.", "1 2 3 4 5.", "seven small boats sail."]
ALL_KERNELS = {"fast_rms_layernorm": True, "fast_rope_embeddings": True, "fast_swiglu": True,
               "fused_linear_loss": True}
# the interpreter's RoPE kernel takes most of a step's time here: the runs that are not about it leave it out
NO_ROPE = {**ALL_KERNELS, "fast_rope_embeddings": False}
LOSS_ONLY = {"fused_linear_loss": True}
METRICS = ("entropy", "mean_token_accuracy", "num_tokens")


@pytest.fixture
def calls(monkeypatch):
    """Counts foak's linear_cross_entropy calls and the forwards of TRL's own ChunkedLogProbFunction."""
    counts = {"foak": 0, "trl": 0}
    foak_lce, trl_forward = lce_module.linear_cross_entropy, ChunkedLogProbFunction.forward

    def counting_foak(*args, **kwargs):
        counts["foak"] += 1
        return foak_lce(*args, **kwargs)

    def counting_trl(*args, **kwargs):
        counts["trl"] += 1
        return trl_forward(*args, **kwargs)

    monkeypatch.setattr(lce_module, "linear_cross_entropy", counting_foak)
    monkeypatch.setattr(ChunkedLogProbFunction, "forward", staticmethod(counting_trl))
    return counts


def _sft_step(tmp_path, patch: str, packing: bool = False, checkpointing: bool = True, kernels=None,
              lora: str | None = None, **config_overrides):
    """One SGD step of SFTTrainer on a tiny Llama; returns (loss, updates of the trained parameters, trainer,
    foak's report or None).
    ``lora``: "model" wraps the model with peft.get_peft_model, "trainer" passes peft_config to SFTTrainer."""
    kernels = kernels or ALL_KERNELS
    tokenizer = char_tokenizer()
    model = tiny_model("llama")
    model.resize_token_embeddings(len(tokenizer))
    lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                  init_lora_weights=False)  # non-zero B: every LoRA parameter gets a gradient
    if lora == "model":
        torch.manual_seed(5)
        model = peft.get_peft_model(model, lora_config)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = foak.patch(model, **kernels) if patch == "foak.patch" else None
    config = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=len(TEXTS), learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=1e9, report_to="none", save_strategy="no", seed=3,
        max_length=64, packing=packing, padding_free=packing, dataset_num_proc=None, logging_steps=1,
        **{"bf16": False, "gradient_checkpointing": checkpointing,  # TRL defaults: bf16 and checkpointing on
           **config_overrides})
    dataset = datasets.Dataset.from_dict({"text": TEXTS})
    callbacks = [FoakCallback(**kernels)] if patch == "callback" else None
    if lora == "trainer":
        torch.manual_seed(5)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=callbacks, peft_config=lora_config if lora == "trainer" else None)
    if patch == "callback":
        report = callbacks[0].report
    if patch != "none":
        assert is_patched(trainer.model)
    if lora == "trainer":
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    loss = trainer.train().training_loss
    updates = {n: p.detach() - start[n] for n, p in trainer.model.named_parameters() if p.requires_grad}
    return loss, updates, trainer, report


def _logged(trainer) -> dict:
    return {key: trainer.state.log_history[0][key] for key in METRICS}


def _assert_same_step(run, ref, metrics_rtol=1e-4):
    (loss, updates, trainer, _), (ref_loss, ref_updates, ref_trainer, _) = run, ref
    assert torch.isfinite(torch.tensor(loss)) and abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert updates.keys() == ref_updates.keys()
    for name, update in ref_updates.items():
        assert update.abs().max() > 0, name  # every trained parameter moved
        assert relative_error(updates[name], update) < 1e-4, name
    logged, ref_logged = _logged(trainer), _logged(ref_trainer)
    assert logged["num_tokens"] == ref_logged["num_tokens"] > 0
    assert logged["mean_token_accuracy"] == ref_logged["mean_token_accuracy"]  # no ties on this model
    assert abs(logged["entropy"] - ref_logged["entropy"]) <= metrics_rtol * ref_logged["entropy"]


def _reference(tmp_path, calls, *args, **kwargs):
    before = dict(calls)
    ref = _sft_step(tmp_path / "ref", "none", *args, **kwargs)
    assert calls["trl"] - before["trl"] == 1 and calls["foak"] == before["foak"]  # the counters see TRL's calls
    return ref


# every switch through the kernels (Triton interpreter) once, with packing, checkpointing and TRL's compact
# scoring; the other ways in (callback, no packing, no checkpointing) run the same patched forwards and op calls on
# foak's torch reference ops (the interpreter costs ~1 s per kernel and step here)
@pytest.mark.parametrize(("patch", "packing", "checkpointing", "compact", "kernels", "ops"), [
    ("foak.patch", False, True, False, NO_ROPE, "reference"), ("callback", False, True, True, NO_ROPE, "reference"),
    ("foak.patch", True, True, True, ALL_KERNELS, "kernels"), ("callback", True, False, False, NO_ROPE, "reference")])
def test_sft_trainer_step_runs_foaks_loss_and_matches_the_unpatched_model(tmp_path, calls, monkeypatch, request,
                                                                          patch, packing, checkpointing, compact,
                                                                          kernels, ops):
    if ops == "reference":
        request.getfixturevalue("reference_ops")
    if compact:  # what TRL does on CUDA: only the positions with a label are scored (CPU: every position)
        monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    run = _sft_step(tmp_path / "foak", patch, packing, checkpointing, kernels)
    assert calls == {"foak": 1, "trl": 0}  # one micro-batch: foak's loss once, TRL's kernel never
    row = run[3].result("llama.fused_linear_loss")
    assert row.modules == 1 and row.notes == "served TRL's fused LM head (1 call)"
    # the unpatched reference run below uses TRL's kernel while the patched model lives: its row counts that
    _assert_same_step(run, _reference(tmp_path, calls, packing, checkpointing))
    assert row.notes == "served TRL's fused LM head (1 call); TRL's own kernel ran 1 call: " + OTHER_MODEL


@pytest.mark.parametrize("lora,patch", [("model", "foak.patch"), ("trainer", "callback"), ("trainer", "foak.patch")])
def test_sft_trainer_with_a_lora_model_runs_foaks_loss(tmp_path, calls, lora, patch):
    # ("trainer", "foak.patch"): patched first, then TRL wraps the patched model with peft_config: the LoRA
    # layers TRL adds are fused from the first forward on
    kernels = {**LOSS_ONLY, "fused_lora": True} if (lora, patch) == ("trainer", "foak.patch") else LOSS_ONLY
    run = _sft_step(tmp_path / "foak", patch, kernels=kernels, lora=lora)
    assert isinstance(run[2].model, peft.PeftModel)
    assert calls == {"foak": 1, "trl": 0}
    ref = _reference(tmp_path, calls, kernels=LOSS_ONLY, lora=lora)
    assert all("lora_" in name for name in ref[1])
    _assert_same_step(run, ref)
    if "fused_lora" in kernels:
        row = run[3].result("llama.fused_lora")
        # 4 LoRA layers, each run again by gradient checkpointing's recompute
        assert row.modules == 4 and "fused 8 calls" in row.notes and "after foak.patch" in row.notes, row.notes


def test_sft_trainer_with_label_smoothing_leaves_the_loss_to_the_logits(tmp_path, calls):
    # TRL computes a smoothed loss from model(**inputs without labels): foak's loss rule keeps the logits (no
    # labels, nothing to fuse) and serves only TRL's no-grad fused head for the metrics
    run = _sft_step(tmp_path / "foak", "foak.patch", kernels=LOSS_ONLY, label_smoothing_factor=0.1)
    assert calls == {"foak": 1, "trl": 0}
    _assert_same_step(run, _reference(tmp_path, calls, kernels=LOSS_ONLY, label_smoothing_factor=0.1))


def test_sft_trainer_under_bf16_autocast_runs_foaks_loss(tmp_path, calls):
    # TRL's default precision: bf16 autocast over these fp32 weights
    run = _sft_step(tmp_path / "foak", "foak.patch", kernels=LOSS_ONLY, bf16=True, use_cpu=True)
    assert calls == {"foak": 1, "trl": 0}
    ref = _reference(tmp_path, calls, kernels=LOSS_ONLY, bf16=True, use_cpu=True)
    fp32 = _reference(tmp_path / "fp32", calls, kernels=LOSS_ONLY)
    assert abs(run[0] - ref[0]) <= 1e-4 * ref[0]
    foak_error = max(relative_error(run[1][name], update) for name, update in fp32[1].items())
    trl_error = max(relative_error(ref[1][name], update) for name, update in fp32[1].items())
    assert 0 < foak_error <= 1.5 * trl_error  # foak's bf16 step is as close to the fp32 step as TRL's own
    logged, ref_logged = _logged(run[2]), _logged(ref[2])
    assert logged["num_tokens"] == ref_logged["num_tokens"]
    assert logged["mean_token_accuracy"] == ref_logged["mean_token_accuracy"]
    assert abs(logged["entropy"] - ref_logged["entropy"]) <= 1e-4 * ref_logged["entropy"]


# ---- the stand-in for TRL's kernel, called directly --------------------------------------------------------
N = 37  # rows scored in the direct calls


def _patched_head():
    model = tiny_model("llama")
    report = foak.patch(model, fused_linear_loss=True)
    return model, report, model.lm_head.weight


def _inputs(weight, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, weight.shape[1], generator=g).requires_grad_()
    b = (0.3 * torch.randn(weight.shape[0], generator=g)).requires_grad_() if bias else None
    targets = torch.randint(0, weight.shape[0], (N,), generator=g)
    logits = hidden.double() @ weight.double().t() + (b.double() if bias else 0)
    targets[::2] = logits.argmax(-1)[::2]  # half the rows predicted right: is_top1 is not all False
    return hidden, b, targets


def _run(function, hidden, weight, bias, targets, row_grad, temperature=1.0, softcap=None, logit_scale=1.0,
         outputs=("log_probs", "entropy", "is_top1"), entropy_grad=None):
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    for t in leaves:
        t.grad = None
    log_probs, entropy, lssp, mean_logits, is_top1 = function.apply(
        hidden, weight, bias, targets, temperature, 32768, softcap, logit_scale, outputs)
    loss = -(log_probs * row_grad).sum()
    if entropy_grad is not None:
        loss = loss + (entropy * entropy_grad).sum()
    loss.backward()
    return [log_probs.detach(), entropy.detach() if entropy is not None else None, is_top1,
            *(t.grad.clone() for t in leaves)]


@pytest.mark.parametrize(("temperature", "logit_scale", "softcap", "bias", "row_grad"), [
    (1.0, 1.0, None, False, "equal"), (0.7, 1.3, None, True, "equal"), (1.0, 0.5, 20.0, False, "equal"),
    (1.3, 1.0, None, False, "dft")])
def test_stand_in_computes_what_trls_kernel_computes(calls, temperature, logit_scale, softcap, bias, row_grad):
    model, report, weight = _patched_head()
    stand_in = trl_utils._ChunkedLogProbFunction
    assert stand_in is not ChunkedLogProbFunction and not is_patched(tiny_model("llama"))
    hidden, b, targets = _inputs(weight, bias=bias)
    # "dft": TRL's loss_type="dft" weights each token's loss by its probability: unequal row gradients
    grad = torch.full((N,), 1 / N) if row_grad == "equal" else torch.rand(N, generator=torch.Generator().manual_seed(1))
    kwargs = dict(temperature=temperature, softcap=softcap, logit_scale=logit_scale)
    out = _run(stand_in, hidden, weight, b, targets, grad, **kwargs)
    assert calls == {"foak": 1, "trl": 0}
    ref = _run(ChunkedLogProbFunction, hidden, weight, b, targets, grad, **kwargs)
    assert calls == {"foak": 1, "trl": 1}
    log_probs, entropy, is_top1, *grads = out
    assert relative_error(log_probs, ref[0]) < 1e-5 and relative_error(entropy, ref[1]) < 1e-5
    assert is_top1.dtype == torch.bool and torch.equal(is_top1, ref[2]) and 0 < int(is_top1.sum()) < N
    for got, want in zip(grads, ref[3:]):
        assert relative_error(got, want) < 1e-5
    assert report.result("llama.fused_linear_loss").notes == "served TRL's fused LM head (1 call)"


def test_stand_in_differentiates_the_entropy_itself(calls):
    # SFT's request (is_top1) runs linear_cross_entropy, whose entropy has no gradient: a caller that
    # differentiates it gets the gradient from foak's linear_log_probs, never from TRL's kernel
    model, report, weight = _patched_head()
    hidden, b, targets = _inputs(weight)
    row_grad, entropy_grad = torch.full((N,), 1 / N), torch.linspace(-1, 1, N)
    out = _run(trl_utils._ChunkedLogProbFunction, hidden, weight, None, targets, row_grad, entropy_grad=entropy_grad)
    assert calls == {"foak": 1, "trl": 0}
    ref = _run(ChunkedLogProbFunction, hidden, weight, None, targets, row_grad, entropy_grad=entropy_grad)
    for got, want in zip(out[3:], ref[3:]):
        assert relative_error(got, want) < 1e-5
    assert report.result("llama.fused_linear_loss").notes == "served TRL's fused LM head (1 call)"


def test_stand_in_hands_what_foak_cannot_compute_to_trl_and_reports_it(calls, monkeypatch):
    model, report, weight = _patched_head()
    hidden, _, targets = _inputs(weight)
    stand_in = trl_utils._ChunkedLogProbFunction
    with pytest.warns(UserWarning, match="'bogus'"):
        _run(stand_in, hidden, weight, None, targets, 1.0, outputs=("log_probs", "bogus"))
    weight.ds_id = 7  # how DeepSpeed ZeRO-3 marks a partitioned parameter
    _run(stand_in, hidden, weight, None, targets, 1.0)
    del weight.ds_id
    # FSDP2: TRL passes lm_head.weight.full_tensor(), a new tensor, for a DTensor weight (here without a graph
    # back to the parameter, as for a frozen head)
    with monkeypatch.context() as m:
        m.setattr("foak.integrations.trl._sharded", lambda w: w is weight)
        _run(stand_in, hidden, weight.detach().clone().requires_grad_(), None, targets, 1.0)
    other = tiny_model("llama").lm_head.weight  # a model foak did not patch: TRL's kernel, counted in the row
    with pytest.warns(UserWarning, match="a model foak did not patch"):
        _run(stand_in, hidden, other, None, targets, 1.0)
    assert calls == {"foak": 0, "trl": 4}
    assert report.result("llama.fused_linear_loss").notes.split("; ") == [
        "TRL's own kernel ran 1 call: outputs ['bogus'] requested (foak computes ['log_probs', 'entropy', "
        "'log_sum_sq_probs', 'mean_logits', 'is_top1'])",
        "TRL's own kernel ran 1 call: lm_head partitioned by DeepSpeed ZeRO-3 (TRL re-gathers it in its backward)",
        "TRL's own kernel ran 1 call: lm_head sharded as a DTensor (FSDP2) and gathered without a gradient (a "
        "frozen head or a no-grad forward): foak cannot tell TRL's gathered copy from another model's head",
        "TRL's own kernel ran 1 call: a model foak did not patch called it (a reference model the trainer loaded "
        "itself? foak.patch(trainer.ref_model) serves it)"]


def test_stand_in_is_installed_while_a_patched_model_exists_and_restored_after():
    gc.collect()  # patched models of earlier tests (a patched model is in a reference cycle)
    assert trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction
    first, second = tiny_model("llama"), tiny_model("llama")
    foak.patch(first, fused_linear_loss=True)
    foak.patch(second, fused_linear_loss=True)
    stand_in = trl_utils._ChunkedLogProbFunction
    assert stand_in is not ChunkedLogProbFunction
    foak.restore(first)
    assert trl_utils._ChunkedLogProbFunction is stand_in
    del second  # garbage-collected without a restore
    gc.collect()
    assert trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction
    foak.patch(first, fast_rms_layernorm=True)  # a config without fused_linear_loss installs nothing
    assert trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction


def test_trl_imported_after_patching_is_served(monkeypatch):
    gc.collect()
    # as if trl.trainer.utils had not been imported yet (the module object the tests hold stays untouched)
    monkeypatch.delitem(sys.modules, "trl.trainer.utils")
    monkeypatch.setattr(trl.trainer, "utils", trl_utils)
    model = tiny_model("llama")
    foak.patch(model, fused_linear_loss=True)
    assert trl_utils._ChunkedLogProbFunction is ChunkedLogProbFunction
    imported = importlib.import_module("trl.trainer.utils")  # e.g. `from trl import SFTTrainer` after foak.patch
    assert imported is not trl_utils
    assert isinstance(imported._ChunkedLogProbFunction, foak_trl._FoakChunkedLogProb)
    assert foak_trl._HOOK not in sys.meta_path  # the import hook is gone once it has installed the stand-in
    foak.restore(model)
    assert imported._ChunkedLogProbFunction is ChunkedLogProbFunction
