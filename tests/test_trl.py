"""foak in a TRL SFTTrainer script: patched before building the trainer, or through FoakCallback."""

import datasets  # pinned in requirements-test.txt with trl: a missing install fails, never skips
import pytest
import torch
import trl

import foak
from foak.data import char_tokenizer
from foak.integrations import FoakCallback
from foak.models.tiny import tiny_model
from foak.patching import is_patched
from foak.testing import relative_error

TEXTS = ["the cat sees the ball.", "a dog likes two apples at home.", "1 2 3 4 5.", "our team calls the river.",
         "seven small boats sail.", "rain falls on the hill."]
ALL_KERNELS = {"fast_rms_layernorm": True, "fast_rope_embeddings": True, "fast_swiglu": True,
               "fused_linear_loss": True}


def _sft_step(tmp_path, patch: str, packing: bool = False, checkpointing: bool = True):
    """One SGD step of SFTTrainer on a tiny Llama; returns (loss, parameter updates, trainer)."""
    tokenizer = char_tokenizer()
    model = tiny_model("llama")
    model.resize_token_embeddings(len(tokenizer))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    if patch == "foak.patch":
        foak.patch(model, **ALL_KERNELS)
    config = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=6, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=1e9, report_to="none", save_strategy="no", seed=3,
        max_length=64, packing=packing, padding_free=packing, dataset_num_proc=None, logging_steps=1,
        bf16=False, gradient_checkpointing=checkpointing)  # TRL defaults: bf16 and checkpointing on
    dataset = datasets.Dataset.from_dict({"text": TEXTS})
    callbacks = [FoakCallback(**ALL_KERNELS)] if patch == "callback" else None
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=callbacks)
    if patch != "none":
        assert is_patched(model)
    loss = trainer.train().training_loss
    updates = {n: p.detach() - start[n] for n, p in model.named_parameters()}
    return loss, updates, trainer


@pytest.mark.parametrize(("patch", "packing", "checkpointing"), [
    ("foak.patch", False, True), ("callback", False, True), ("foak.patch", True, True), ("callback", True, False)])
def test_sft_trainer_step_matches_the_unpatched_model(tmp_path, patch, packing, checkpointing):
    loss, updates, _ = _sft_step(tmp_path / "foak", patch, packing, checkpointing)
    ref_loss, ref_updates, _ = _sft_step(tmp_path / "ref", "none", packing, checkpointing)
    assert torch.isfinite(torch.tensor(loss)) and abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for name, update in ref_updates.items():
        assert update.abs().max() > 0, name  # every parameter moved
        assert relative_error(updates[name], update) < 1e-4, name
