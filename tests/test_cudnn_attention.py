"""The cudnn_attention switch: unpacked causal batches going to SDPA ask for cuDNN's attention first (CUDA sm90+,
fp16/bf16, no mask). This machine has no GPU: the tests check the switch's validation, that the calls it cannot
serve keep transformers' sdpa exactly and are counted with the reason, and the priority context it enters;
benchmarks/attention_backends.py --model-check runs the cuDNN path on the H200 against flash and fp32."""

from __future__ import annotations

import copy

import pytest
import torch

import foak
from foak.config import config_from_kwargs
from foak.models.tiny import tiny_model
from foak.patching import packed_attention as pa
from foak.patching.packed_attention import packed_attention_counts


def test_cudnn_attention_needs_fast_packed_attention():
    with pytest.raises(ValueError, match="cudnn_attention: true .* works through foak's attention function: add "
                                         "fast_packed_attention: true"):
        config_from_kwargs("full", cudnn_attention=True)
    assert config_from_kwargs("full", cudnn_attention=True, fast_packed_attention=True).cudnn_attention


def test_calls_cudnn_cannot_take_run_sdpa_unchanged_and_are_counted():
    torch.manual_seed(0)
    ref = tiny_model("llama").float()
    model = copy.deepcopy(ref)
    report = foak.patch(model, fast_packed_attention=True, cudnn_attention=True)
    ids = torch.randint(3, model.config.vocab_size, (2, 19))
    expected = ref(input_ids=ids, labels=ids).loss
    got = model(input_ids=ids, labels=ids).loss
    assert torch.equal(got, expected)  # the previous implementation itself (bit-identical)
    _, other = packed_attention_counts(report, "llama.packed_attention")
    layers = model.config.num_hidden_layers
    assert other == {"not a packed batch: sdpa without cuDNN attention (not on CUDA)": layers}, other
    foak.restore(model)


def test_without_the_switch_the_reason_is_unchanged():
    model = tiny_model("llama").float()
    # patched with the switch, restored, patched without it: the switch is off (it stayed on before)
    foak.patch(model, fast_packed_attention=True, cudnn_attention=True)
    foak.restore(model)
    report = foak.patch(model, fast_packed_attention=True)
    ids = torch.randint(3, model.config.vocab_size, (1, 7))
    model(input_ids=ids)
    assert packed_attention_counts(report, "llama.packed_attention")[1] == {
        "not a packed batch": model.config.num_hidden_layers}
    foak.restore(model)


def test_reasons_cudnn_declines_before_it_is_asked():
    q = torch.zeros(1, 4, 8, 16)
    assert pa._cudnn_declines(q, q, q, None, {}) == "not on CUDA"


def test_the_priority_puts_cudnn_first_and_is_restored():
    from torch.nn.attention import SDPBackend

    before = list(torch._C._get_sdp_priority_order())
    with pa._sdpa_cudnn_first():
        inside = list(torch._C._get_sdp_priority_order())
    assert inside[:2] == [int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.FLASH_ATTENTION)], inside
    assert list(torch._C._get_sdp_priority_order()) == before
