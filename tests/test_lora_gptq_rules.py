"""fused_lora on a GPTQ-LoRA model: a tiny Llama quantized by foak's round-to-nearest GPTQ quantizer
(foak.quant), saved and loaded back, wrapped by peft.get_peft_model with foak's GPTQLoraLinear, against the
same model unpatched (foak's own unfused GPTQLinear path): loss and every adapter gradient, the report's
base detection and call counts, and PEFT's path for a compute dtype that does not fit."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_lora_rules import ATTENTION, LAYERS, MLP, OTHER_SWITCHES, assert_same_training, calls

import foak
from foak.models.tiny import tiny_model
from foak.quant import load_gptq, quantize_model_gptq, save_gptq
from foak.quant.gptq_peft import register_gptq_lora


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gptq")
    torch.manual_seed(0)
    save_gptq(quantize_model_gptq(tiny_model("llama"), group_size=32, act_order=True), path)
    return path


def gptq_lora(path, dtype, targets=ATTENTION + MLP):
    model = load_gptq(path, dtype=dtype)
    config = register_gptq_lora(LoraConfig(r=7, lora_alpha=14, target_modules=list(targets),
                                           init_lora_weights=False))
    torch.manual_seed(1)
    return get_peft_model(model, config)


def test_gptq_fp32_matches_the_unfused_path(gptq_dir):
    ref = gptq_lora(gptq_dir, torch.float32)
    model = copy.deepcopy(ref)
    report = foak.patch(model, fused_lora=True, **OTHER_SWITCHES)
    row = report.result("llama.fused_lora")
    assert row.modules == LAYERS * 7 and "bases: 14 foak GPTQ-4bit GPTQLinear" in row.notes, str(report)
    assert_same_training(model, ref)
    assert calls(report) == (LAYERS * 7, {}), row.notes
    assert "forwards as fused LoRA MLP blocks" in report.result("llama.swiglu").notes
    assert "forwards with q/k/v as one fused LoRA block" in report.result("llama.fused_lora_qkv").notes


def test_gptq_bf16_under_autocast_and_an_input_dtype_that_does_not_fit(gptq_dir):
    ref = gptq_lora(gptq_dir, torch.bfloat16, targets=["v_proj", "down_proj"])
    model = copy.deepcopy(ref)
    report = foak.patch(model, fused_lora=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_same_training(model, ref, tol=2e-2)
    assert calls(report) == (LAYERS * 2, {})
    layer = model.base_model.model.model.layers[0].self_attn.v_proj
    x = torch.randn(3, layer.in_features)  # fp32 into a layer computing in bf16, outside autocast: PEFT's path
    out = layer(x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert calls(report)[1] == {"torch.float32 input into a GPTQ layer computing in torch.bfloat16": 1}


def test_gptq_linear_under_autocast_runs_its_gemm_in_the_autocast_dtype():
    """An fp32-compute GPTQLinear under bf16 autocast: the GEMM in bf16 as nn.Linear's would be (forward and
    backward), the result in x's dtype as bitsandbytes' 4-bit layers return it."""
    from torch import nn

    from foak.quant import GPTQLinear

    torch.manual_seed(2)
    dense = nn.Linear(64, 40, bias=True)
    layer = GPTQLinear.from_linear(dense, group_size=32)
    w = layer.dequantize(torch.float32)
    from foak.ops import gptq_matmul as mm_mod

    x = torch.randn(3, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = layer(x)  # 3 rows: the GEMM with the dequantization inside (foak.ops.gptq_matmul)
        mm_mod.TUNING["max_rows"], max_rows = 0, mm_mod.TUNING["max_rows"]
        try:
            out = layer(x)  # dequantize + torch's GEMM
        finally:
            mm_mod.TUNING["max_rows"] = max_rows
        ref = nn.functional.linear(x.detach().bfloat16(), w.bfloat16(), layer.bias.bfloat16())
    assert out.dtype == torch.float32 and torch.equal(out, ref.float())
    exact = nn.functional.linear(x.detach().bfloat16().double(), w.bfloat16().double(), layer.bias.bfloat16().double())
    assert fused.dtype == torch.float32
    assert (fused.double() - exact).abs().max() <= 2 * (ref.double() - exact).abs().max() + 1e-6
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert gx.dtype == torch.float32
    assert torch.equal(gx, (torch.ones(3, 40, dtype=torch.bfloat16) @ w.bfloat16()).float())
