"""What a long sequence allocates in foak's path: no [L, V] logits, no [L, L] scores, no whole [L, I] MLP tensor.

Every op's output during a training step (forward, checkpoint recompute, backward) is watched through a
TorchDispatchMode, with foak's kernels (Triton's interpreter here) and its long-context switches:
fused_linear_loss with a small logits chunk, tiled_mlp, a packed row of two sequences without a mask through
foak's varlen attention, gradient checkpointing; full fine-tuning and LoRA. Flagged: an output with a vocabulary
dimension and more than L x V / 4 elements, one with an intermediate dimension and more than L x I / 4, one with
two dimensions of L or more. (On the CPU the varlen attention computes each sequence's scores with SDPA's math
path, [heads, S, S] for a sequence of S < L tokens; on CUDA it is flash. The interpreter's own argument copies,
aten.set_/copy_, are not ops of foak's.) The unpatched model is flagged (the test can fail).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import foak
from foak.patching import replacements

L, HIDDEN, INTER, VOCAB = 256, 32, 160, 401  # one packed row of two sequences (100 + 156 tokens)


class LargestOutputs(TorchDispatchMode):
    """Op outputs of sequence-by-vocabulary, sequence-by-intermediate or sequence-squared size (numel, op, shape)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.set_.source_Storage, torch.ops.aten.copy_.default):
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and too_large(tuple(t.shape)):
                self.seen.append((t.numel(), str(func), tuple(t.shape)))
        return out


def too_large(shape: tuple) -> bool:
    numel = 1
    for d in shape:
        numel *= d
    return ((VOCAB in shape and numel > L * VOCAB // 4) or (INTER in shape and numel > L * INTER // 4)
            or sum(d >= L for d in shape) >= 2)


def model_for(lora: bool):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                      max_position_embeddings=L, use_cache=False)
    model = transformers.LlamaForCausalLM(config).float().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        model.enable_input_require_grads()
    return model


def packed_batch():
    ids = torch.randint(3, VOCAB, (1, L), generator=torch.Generator().manual_seed(0))
    half = 100
    position_ids = torch.cat([torch.arange(half), torch.arange(L - half)])[None]
    return dict(input_ids=ids, labels=ids.clone(), position_ids=position_ids)


def step(model, data):
    with LargestOutputs() as mode:
        model(**data).loss.backward()
    return sorted(mode.seen, reverse=True)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_foaks_long_context_path_allocates_nothing_of_sequence_squared_or_vocab_size(lora, monkeypatch):
    # a logits chunk of 16 rows (the default budget is 512 MiB: the whole [L, V] of a tiny model fits in it)
    monkeypatch.setattr(replacements, "FUSED_LOSS_CHUNK_BYTES", 16 * VOCAB * 4)
    monkeypatch.setattr(replacements, "FUSED_LOSS_CHUNK_BYTES_FP32_ACCUMULATION", 16 * VOCAB * 4)
    model = model_for(lora)
    switches = {**foak.api.default_config(model).model_dump(exclude={"mode"}),
                "tiled_mlp": True, "tiled_mlp_chunk_tokens": 32}
    assert switches["fused_linear_loss"] and switches["fast_packed_attention"]
    report = foak.patch(model, **switches)
    try:
        seen = step(model, packed_batch())
    finally:
        foak.restore(model)
    assert seen == [], f"[L, V] / [L, I] / [L, L]-sized outputs: {seen[:5]}"
    assert "foak varlen attention ran 0 calls" not in report.result("llama.packed_attention").notes


def test_the_unpatched_model_exceeds_the_bound():
    seen = step(model_for(lora=False), packed_batch())
    shapes = {shape for _, _, shape in seen}
    assert (1, L, VOCAB) in shapes or (L, VOCAB) in shapes, sorted(shapes)[:8]
    assert (1, L, INTER) in shapes or (L, INTER) in shapes, sorted(shapes)[:8]
