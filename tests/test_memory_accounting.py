"""foak's decoder rules add no memory over the unpatched model: what the forward keeps for the backward
(saved-tensor bytes; live bytes after the forward) and the peak of live tensor memory over the forward and
over forward + backward, for full fine-tuning and PEFT LoRA, without gradient checkpointing and under HF's
(non-reentrant and reentrant). Counted on CPU with the Triton kernels in the interpreter (tests/memory_utils.py).

The tiny Llama is shaped so that [tokens, intermediate] tensors dominate (intermediate = 8 x hidden), as at
long context; numbers are reported in units of one [L, I] tensor. One slack, stated: the forward's peak may
exceed the unpatched one by one [L, hidden] tensor and 4 bytes per token: the fused down projection
(foak.ops.glu_linear / lora_glu_linear) writes its output while g, u and act(g) * u are alive, where HF has
already dropped act(g) and u, and the norm's fp32 row statistics (under reentrant checkpointing) are alive
then too (transients of one layer, not kept; the forward + backward peak and what the forward keeps have no
slack).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import foak
from memory_utils import saved_tensor_bytes, step_memory

L, HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 32, 32, 256, 3, 32
UNIT = L * INTERMEDIATE * 4  # one fp32 [L, I] tensor
SLACK_FORWARD = L * HIDDEN * 4 + L * 4  # one fp32 [L, hidden] tensor and one fp32 value per token (see above)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SWITCHES = dict(fast_rms_layernorm=True, fast_rope_embeddings=True, fast_swiglu=True, fused_linear_loss=True)


def tiny_llama(lora: bool, checkpointing):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                      max_position_embeddings=L, use_cache=False)
    model = transformers.LlamaForCausalLM(config).float()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    model.train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
        if checkpointing:  # reentrant checkpointing needs an input that requires grad (as HF Trainer sets up)
            model.enable_input_require_grads()
    return model


def batch():
    ids = torch.randint(0, VOCAB, (1, L), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def units(n: int) -> str:
    return f"{n / UNIT:.3f} [L, I]"


_CASES = [(lora, ckpt) for lora in (False, True) for ckpt in (None, False, True)]
_IDS = [f"{'lora' if lora else 'full'}-{ {None: 'no_ckpt', False: 'ckpt', True: 'ckpt_reentrant'}[ckpt]}"
        for lora, ckpt in _CASES]


@pytest.mark.parametrize(("lora", "checkpointing"), _CASES, ids=_IDS)
def test_patched_model_adds_no_memory(lora, checkpointing):
    ref = tiny_llama(lora, checkpointing)
    model = copy.deepcopy(ref)
    foak.patch(model, **SWITCHES, **({"fused_lora": True} if lora else {}))
    try:
        data = batch()
        base, ours = step_memory(ref, data), step_memory(model, data)
    finally:
        foak.restore(model)
    summary = (f"unpatched: retained {units(base['retained'])}, forward peak {units(base['forward_peak'])}, "
               f"peak {units(base['peak'])}; foak: retained {units(ours['retained'])}, forward peak "
               f"{units(ours['forward_peak'])}, peak {units(ours['peak'])}")
    assert ours["retained"] <= base["retained"], summary
    assert ours["forward_peak"] <= base["forward_peak"] + SLACK_FORWARD, summary
    assert ours["peak"] <= base["peak"], summary


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_rms_norm_recompute_keeps_no_norm_input_under_checkpointing(lora):
    """The rms_norm_recompute scope (foak.ops._recompute) must not keep the inputs of norms whose output
    nobody saved: under non-reentrant checkpointing that held every layer's post-attention norm input until
    the decoder stack returned (LAYERS - 1 extra [L, hidden] tensors at the end of the forward). For LoRA
    the baseline is fused_lora alone (PEFT's own layers keep more)."""
    ref = tiny_llama(lora, False)
    base_model = copy.deepcopy(ref)
    model = copy.deepcopy(ref)
    extra = {"fused_lora": True} if lora else {}
    if lora:
        foak.patch(base_model, **extra)
    foak.patch(model, fast_rms_layernorm=True, **extra)
    try:
        data = batch()
        base, ours = step_memory(base_model, data), step_memory(model, data)
    finally:
        foak.restore(model)
        if lora:
            foak.restore(base_model)
    # (+ the norm's fp32 row statistics, one value per token, alive at the forward's peak)
    assert ours["forward_peak"] <= base["forward_peak"] + L * 4, (units(ours["forward_peak"]),
                                                                   units(base["forward_peak"]))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_saved_tensor_bytes(lora):
    """What autograd saves in the forward (saved_tensors_hooks; foak's rms_norm_recompute scope steps aside
    under such a hook, so this is without that saving), per layer, patched <= unpatched."""
    ref = tiny_llama(lora, None)
    model = copy.deepcopy(ref)
    foak.patch(model, **SWITCHES, **({"fused_lora": True} if lora else {}))
    data = batch()
    try:
        params = [*ref.parameters(), *model.parameters(), *data.values()]
        base, _ = saved_tensor_bytes(lambda: ref(**data).loss, exclude=params)
        ours, _ = saved_tensor_bytes(lambda: model(**data).loss, exclude=params)
    finally:
        foak.restore(model)
    assert ours <= base, f"saved per layer: foak {units(ours / LAYERS)}, unpatched {units(base / LAYERS)}"
