"""fused_lora on a QLoRA model: a tiny Llama quantized by bitsandbytes (NF4, double-quantized absmax, on
CPU) and wrapped by peft.get_peft_model, against the same model unpatched (PEFT + bitsandbytes' own
forward and backward): loss and every adapter gradient, the report's base detection and call counts,
PEFT's path for dtypes bitsandbytes would round differently, and no dense weight kept for the backward.

Where bitsandbytes' CPU dequantize_4bit is wrong (bitsandbytes 0.50.2 on AVX-512 CPUs, for the tiny Llama's
down_proj rows of 96: foak.patching.bnb_cpu), the unpatched model dequantizes by the NF4 formula instead
(foak.testing.bitsandbytes_dequant_by_formula), so the comparison is with NF4 math, not with that defect."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_lora_rules import ATTENTION, LAYERS, MLP, OTHER_SWITCHES, assert_same_training, batch, calls, \
    loss_and_grads

import foak
from foak.models.tiny import tiny_model
from foak.testing import bitsandbytes_dequant_by_formula, relative_error


@pytest.fixture(autouse=True, scope="module")
def _nf4_by_formula():
    with bitsandbytes_dequant_by_formula():
        yield


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    tiny_model("llama").save_pretrained(path)
    return path


def qlora_llama(path, dtype, compute_dtype, targets=ATTENTION + MLP, dropout=0.0, kbit=False):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=compute_dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quant)
    if kbit:
        import peft

        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    for m in model.modules():
        # bitsandbytes' Linear4bit on an AVX512-BF16 CPU repacks its weight in place for an inference kernel (bf16
        # scales) on its first eval-mode call without grad: the comparisons are with its dequantize + matmul path
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    config = LoraConfig(r=7, lora_alpha=14, target_modules=list(targets), init_lora_weights=False,
                        lora_dropout=dropout)
    torch.manual_seed(1)
    return get_peft_model(model, config)


def patched(ref, **switches):
    model = copy.deepcopy(ref)
    return model, foak.patch(model, **switches)


def test_nf4_fp32_compute_matches_peft_and_keeps_no_dense_weight(saved_tiny):
    ref = qlora_llama(saved_tiny, torch.float32, torch.float32)
    model, report = patched(ref, fused_lora=True, **OTHER_SWITCHES)
    row = report.result("llama.fused_lora")
    assert row.modules == LAYERS * 7 and "bases: 14 bitsandbytes NF4 Linear4bit" in row.notes, str(report)
    assert_same_training(model, ref)
    assert calls(report) == (LAYERS * 7, {}), row.notes
    assert "forwards as fused LoRA MLP blocks" in report.result("llama.swiglu").notes
    # nothing of a dequantized [out, in] weight is saved for the backward
    shapes = {tuple(m.base_layer.weight.quant_state.shape) for m in model.modules() if hasattr(m, "base_layer")
              and hasattr(m.base_layer.weight, "quant_state")}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        model(**batch()).loss.backward()
    assert saved and not shapes & set(saved), shapes & set(saved)


def fp32_copy(qlora):
    """The same quantized model computed in fp32: each 4-bit weight dequantized to fp32 (no bf16 rounding)."""
    ref32 = copy.deepcopy(qlora)
    for m in ref32.modules():
        if hasattr(m, "compute_dtype") and hasattr(getattr(m, "weight", None), "quant_state"):
            m.compute_dtype = torch.float32
            m.weight.quant_state.dtype = torch.float32
    return ref32.float()


@pytest.mark.parametrize("kbit", [False, True], ids=["bf16_model", "prepare_model_for_kbit_training"])
def test_nf4_bf16_compute_under_bf16_autocast(saved_tiny, kbit):
    """The usual QLoRA recipes: a bf16 model, or prepare_model_for_kbit_training's fp32 non-quantized
    parameters (fp32 inputs into the 4-bit layers, whose results are then fp32 as bitsandbytes gives). Each
    adapter gradient's error against an fp32 computation of the same quantized model is compared with
    PEFT's own under the same autocast."""
    ref = qlora_llama(saved_tiny, torch.bfloat16, torch.bfloat16, kbit=kbit)
    model, report = patched(ref, fused_lora=True, fast_swiglu=True)
    _, grads32 = loss_and_grads(fp32_copy(ref))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = loss_and_grads(model)
        peft_loss, peft_grads = loss_and_grads(ref)
    assert abs(loss.item() - peft_loss.item()) <= 2e-2 * abs(peft_loss.item())
    ours = [relative_error(grads[n].float(), g) for n, g in grads32.items()]
    theirs = [relative_error(peft_grads[n].float(), g) for n, g in grads32.items()]
    assert len(ours) == LAYERS * 7 * 2 and all(grads[n].dtype == torch.float32 for n in grads32)
    assert max(ours) <= 2 * max(theirs) and sum(ours) <= 1.5 * sum(theirs), (max(ours), max(theirs))
    assert max(ours) <= 3e-2
    assert calls(report) == (LAYERS * 7, {}), report.result("llama.fused_lora").notes


def test_nf4_rounding_mismatch_takes_peft_path(saved_tiny):
    """An fp32 model quantized with a bf16 compute dtype: bitsandbytes dequantizes to fp32 and then rounds to
    bf16; foak leaves those calls to PEFT and says why."""
    ref = qlora_llama(saved_tiny, torch.float32, torch.bfloat16, targets=["q_proj"])
    model, report = patched(ref, fused_lora=True)
    assert_same_training(model, ref)
    fused, peft_path = calls(report)
    assert fused == 0 and peft_path == {"4-bit weight of dtype torch.float32 computed in torch.bfloat16": LAYERS}


def test_nf4_dropout_masks_are_foaks_and_reproducible(saved_tiny):
    ref = qlora_llama(saved_tiny, torch.float32, torch.float32, targets=["down_proj"], dropout=0.2)
    model, report = patched(ref, fused_lora=True, fast_swiglu=True)
    torch.manual_seed(3)
    loss_a, grads_a = loss_and_grads(model)
    torch.manual_seed(3)
    loss_b, grads_b = loss_and_grads(model)
    model.eval()
    loss_eval, _ = loss_and_grads(model)
    ref.eval()
    assert torch.allclose(loss_eval, loss_and_grads(ref)[0], rtol=1e-5)  # no dropout in eval: PEFT's math
    assert loss_a == loss_b and loss_a != loss_eval
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert calls(report) == (3 * LAYERS, {})


def test_base_layer_setting_is_checked_against_the_model(saved_tiny):
    from test_lora_rules import peft_llama

    stanza = {"peft": {"quantization": {"fused_ops_and_kernels": {"fused_lora": True, "base_layer": "bitsandbytes"}}}}
    model = qlora_llama(saved_tiny, torch.float32, torch.float32, targets=["v_proj"])
    assert foak.patch(model, stanza).result("llama.fused_lora").modules == LAYERS
    foak.restore(model)
    with pytest.raises(ValueError, match="holds no PEFT LoRA layer over a bitsandbytes Linear4bit"):
        foak.patch(peft_llama(["v_proj"]), stanza)
    gptq = {"peft": {"quantization": {"fused_ops_and_kernels": {"fused_lora": True, "base_layer": "gptq"}}}}
    with pytest.raises(ValueError, match="base_layer: gptq, but the model holds no PEFT LoRA layer over a foak GPTQLinear"):
        foak.patch(model, gptq)


def test_lora_ops_take_an_nf4_weight_as_its_dense_dequantization():
    """foak.lora_linear / lora_glu_linear with an NF4Weight equal the same ops on the dense dequantized
    weight (fp32 compute), and say what to do when the compute dtype does not fit."""
    import bitsandbytes.functional as bnbf

    from foak.ops.nf4 import NF4Weight

    gen = torch.Generator().manual_seed(8)
    w = torch.randn(37, 130, generator=gen)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    nf4 = NF4Weight(packed, state.absmax, tuple(state.shape), torch.float32, code=state.code,
                    nested_absmax=state.state2.absmax, nested_code=state.state2.code, offset=state.offset)
    dense = bnbf.dequantize_4bit(packed, state)
    a, b = torch.randn(5, 130, generator=gen) * 0.1, torch.randn(37, 5, generator=gen) * 0.1
    x = torch.randn(2, 3, 130, generator=gen)
    dy = torch.randn(2, 3, 37, generator=gen)
    for p in (0.0, 0.2):
        outs = []
        for weight in (nf4, dense):
            xl, al, bl = (t.clone().requires_grad_() for t in (x, a, b))
            out = foak.lora_linear(xl, weight, None, al, bl, 1.5, dropout_p=p, seed=3)
            outs.append((out, *torch.autograd.grad(out, (xl, al, bl), dy)))
        for ours, ref in zip(*outs):
            assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-6)
    g, u = torch.randn(4, 130, generator=gen), torch.randn(4, 130, generator=gen)
    assert torch.allclose(foak.lora_glu_linear(g, u, nf4, None, a, b, 1.5),
                          foak.lora_glu_linear(g, u, dense, None, a, b, 1.5), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="compute dtype of the quantized base"):
        foak.lora_linear(x.bfloat16(), nf4, None, a.bfloat16(), b.bfloat16(), 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="quantized base computes in"):
        foak.lora_linear(x, nf4, None, a, b, 1.0)
    with pytest.raises(ValueError, match="quantized weight with shape"):
        foak.lora_linear(x, object(), None, a, b, 1.0)
