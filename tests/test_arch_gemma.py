"""Gemma family beyond the matrix (tests/test_architectures.py): the fused loss's check of the final-logit
softcap, packed attention where a multimodal model builds its text tower's masks, an image through Gemma 3."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import foak
from foak.patching.packed_attention import packed_attention_counts
from foak.patching.replacements import _follows_from
from test_architectures import SPECS, assert_close, assert_grads_close, batch_of, build, loss_and_grads, patch


def test_softcap_check_accepts_exactly_tanh_of_the_scaled_loss():
    loss = torch.randn(3, requires_grad=True).sum()
    cap = 30.0
    assert _follows_from(torch.tanh(loss / cap) * cap, loss, None, cap)
    for other in (loss, loss / cap, torch.tanh(loss) * cap, torch.tanh(loss / cap) * cap + 1,
                  torch.sigmoid(loss / cap) * cap, torch.tanh(loss * cap) * cap, torch.tanh(loss / 20.0) * 20.0,
                  torch.tanh(loss / cap) * 20.0, torch.tanh(loss / cap) * torch.tensor(cap, requires_grad=True)):
        assert not _follows_from(other, loss, None, cap)
    assert not _follows_from(torch.tanh(loss / cap) * cap, loss, None, None)  # no softcap expected


def test_gemma2_softcapped_loss_is_not_the_plain_loss():
    """The fused loss applies the cap: with a small cap the softcapped loss differs from the uncapped one by far
    more than the tolerance, and the patched loss equals the unpatched softcapped one."""
    model = build("gemma2")
    model.config.final_logit_softcapping = 0.1  # the tiny model's logits are ~0.2: a cap that bites
    ref = copy.deepcopy(model)
    uncapped = copy.deepcopy(model)
    uncapped.config.final_logit_softcapping = None
    patch(model, "gemma2")
    batch = batch_of("padded")
    out, ref_out, plain = model(**batch), ref(**batch), uncapped(**batch)
    assert out.logits is None
    assert_close(out.loss, ref_out.loss, "gemma2 softcapped loss")
    assert abs(plain.loss.item() - ref_out.loss.item()) > 1e-2 * ref_out.loss.item()


@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_multimodal_packed_batch_runs_foak_attention(arch):
    """Gemma3Model / Gemma4Model build the text tower's masks themselves: the packed batch gets no mask and
    every attention layer runs foak's varlen attention."""
    model = build(arch)
    report = patch(model, arch)
    model(**batch_of("packed")).loss.backward()
    packed, other = packed_attention_counts(report, f"{arch}.packed_attention")
    layers = SPECS[arch].kwargs["text_config"]["num_hidden_layers"]
    assert sum(packed.values()) == layers and not other, (packed, other)


def test_gemma3_with_an_image_matches_unpatched():
    """An image through the SigLIP tower and the projector (whose (1 + w) norm is foak's) into the text model."""
    spec = SPECS["gemma3"]
    config = transformers.Gemma3Config(**{**spec.kwargs, "image_token_index": 5})
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float()
    ref = copy.deepcopy(model)
    foak.set_backend("reference")
    report = foak.patch(model)
    try:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(6, 301, (1, 12), generator=g)
        ids[0, 2:6] = 5  # mm_tokens_per_image image tokens
        labels = ids.masked_fill(ids == 5, -100)
        batch = {"input_ids": ids, "labels": labels, "pixel_values": torch.randn(1, 3, 16, 16, generator=g),
                 "token_type_ids": (ids == 5).long()}
        out, grads = loss_and_grads(model, batch)
        ref_out, ref_grads = loss_and_grads(ref, batch)
        assert_close(out.loss, ref_out.loss, "gemma3 image loss")
        assert_grads_close(grads, ref_grads, "gemma3 image")
        assert grads["model.multi_modal_projector.mm_soft_emb_norm.weight"] is not None
        assert {r.rule_id: r.modules for r in report.results}["gemma3.rms_norm"] == spec.rows["rms_norm"]
    finally:
        foak.restore(model)
        foak.set_backend("auto")


def test_gemma3_packed_batch_with_an_image_keeps_the_image_block():
    """Image tokens attend to each other both ways (token_type_ids): a packed batch with an image keeps
    transformers' mask, equal to unpatched, and the row says so."""
    spec = SPECS["gemma3"]
    config = transformers.Gemma3Config(**{**spec.kwargs, "image_token_index": 5})
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float()
    ref = copy.deepcopy(model)
    foak.set_backend("reference")
    report = foak.patch(model)
    try:
        g = torch.Generator().manual_seed(4)
        lengths = (5, 9, 3)
        ids = torch.randint(6, 301, (1, sum(lengths)), generator=g)
        ids[0, 7:11] = 5  # the image inside the second sequence
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        batch = {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill((pos == 0) | (ids == 5), -100),
                 "pixel_values": torch.randn(1, 3, 16, 16, generator=g), "token_type_ids": (ids == 5).long(),
                 "use_cache": False}
        out, grads = loss_and_grads(model, batch)
        ref_out, ref_grads = loss_and_grads(ref, batch)
        assert_close(out.loss, ref_out.loss, "gemma3 packed image loss")
        assert_grads_close(grads, ref_grads, "gemma3 packed image")
        packed, _ = packed_attention_counts(report, "gemma3.packed_attention")
        assert not packed
        row = next(r for r in report.results if r.rule_id == "gemma3.packed_attention")
        assert "1 forward with image tokens (token_type_ids) kept transformers' mask" in row.notes
    finally:
        foak.restore(model)
        foak.set_backend("auto")
