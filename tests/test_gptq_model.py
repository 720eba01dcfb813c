"""foak.quant.gptq: GPTQLinear (forward/backward vs F.linear on the dequantized weight), quantize -> save ->
load round trip of a tiny Llama, hand-packed v1 / v2 / act-order checkpoints, loader refusals, PEFT LoRA."""

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from foak.models.tiny import tiny_model
from foak.ops.gptq import gptq_dequantize_reference
from foak.quant import GPTQLinear, gptq_error_report_model, load_gptq, quantize_model_gptq, save_gptq

GROUP = 32


def _dense(layer, dtype=torch.float32):
    return gptq_dequantize_reference(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, dtype,
                                     zero_offset=layer.zero_offset)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_linear_forward_backward_match_dense(act_order):
    torch.manual_seed(0)
    linear = nn.Linear(40, 24, bias=True)  # 40 inputs, group 16: groups of 16, 16, 8
    layer = GPTQLinear.from_linear(linear, group_size=16, sym=not act_order, act_order=act_order)
    assert layer.compute_dtype == torch.float32 and not layer.bias.requires_grad
    assert set(layer.state_dict()) == {"qweight", "qzeros", "scales", "g_idx", "bias"}
    w = _dense(layer)
    x = torch.randn(3, 5, 40, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = layer(x)
    assert (24, 40) not in saved and (40, 24) not in saved, saved
    ref = F.linear(x.detach(), w, linear.bias.detach())
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    gy = torch.randn_like(y)
    y.backward(gy)
    torch.testing.assert_close(x.grad, gy @ w, rtol=1e-6, atol=1e-6)
    assert all(b.grad is None and not b.requires_grad for b in layer.buffers()) and layer.bias.grad is None
    # the weight is close to the original (round to nearest, 4 bits)
    err = (w - linear.weight.detach()).norm() / linear.weight.detach().norm()
    assert 0 < float(err) < 0.2
    # bf16 input: computed in fp32, returned in bf16
    yb = layer(x.detach().bfloat16())
    assert yb.dtype == torch.bfloat16
    # cache: one weight object until the storage or compute dtype changes; .to(bf16) keeps fp16 scales
    first = layer.weight_object()
    assert layer.weight_object() is first
    layer.qweight = layer.qweight.clone()  # new storage: rebuilt
    second = layer.weight_object()
    assert second is not first and second.qweight is layer.qweight
    first = second
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == torch.float16 and layer.compute_dtype == torch.bfloat16
    assert layer.bias.dtype == torch.bfloat16 and layer.weight_object() is not first
    assert torch.equal(layer.dequantize(torch.float32), w)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_model("llama")
    dense = tiny_model("llama")
    report = {}
    quantize_model_gptq(model, group_size=GROUP, report=report)
    path = str(tmp_path_factory.mktemp("gptq") / "tiny")
    save_gptq(model, path)
    return model, dense, report, path


def _ids():
    return torch.randint(0, 301, (2, 7), generator=torch.Generator().manual_seed(1))


def test_quantize_save_load_round_trip(checkpoint):
    model, dense, report, path = checkpoint
    qlayers = {n: m for n, m in model.named_modules() if isinstance(m, GPTQLinear)}
    assert len(qlayers) == 14 and isinstance(model.lm_head, nn.Linear)
    assert report == pytest.approx(gptq_error_report_model(dense, model))
    assert all(0 < e < 0.15 for e in report.values()), report
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == 4 and qc["group_size"] == GROUP
    assert qc["checkpoint_format"] == "gptq" and qc["sym"] is True and qc["desc_act"] is False

    loaded = load_gptq(path, dtype=torch.float32)
    for name, layer in qlayers.items():
        other = loaded.get_submodule(name)
        assert isinstance(other, GPTQLinear) and not hasattr(other, "weight")
        for buf in ("qweight", "qzeros", "scales", "g_idx"):
            assert torch.equal(getattr(layer, buf), getattr(other, buf)), (name, buf)
    assert loaded.config.quantization_config["group_size"] == GROUP
    with torch.no_grad():
        expected = model(_ids()).logits
        got = loaded(_ids()).logits
        dense_logits = dense(_ids()).logits
    assert torch.equal(got, expected)
    assert 0 < float((got - dense_logits).norm() / dense_logits.norm()) < 0.3

    bf16 = load_gptq(path)  # default bf16: float parameters bf16, scales kept fp16
    q = bf16.model.layers[0].self_attn.q_proj
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16 and q.compute_dtype == torch.bfloat16
    assert q.scales.dtype == torch.float16 and torch.equal(q.qweight, model.model.layers[0].self_attn.q_proj.qweight)


def _pack_rows(values):
    """[n, 8k] ints 0..15 -> [n, k] int32, lowest nibble first (written independently of foak)."""
    n, m = values.shape
    out = torch.zeros(n, m // 8, dtype=torch.int64)
    for b in range(8):
        out |= values[:, b::8].long() << (4 * b)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _rewrite(src, dst, qc_update, tensor_update):
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"].update(qc_update)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensor_update(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_hand_packed_checkpoint_loads(checkpoint, tmp_path, fmt):
    """One layer replaced by hand-packed asymmetric act-order tensors (zero points 1..15, v1 stores zero - 1)."""
    _, _, _, path = checkpoint
    name = "model.layers.1.mlp.down_proj"  # [64, 96]: in 96, out 64
    gen = torch.Generator().manual_seed(3)
    in_f, out_f, groups = 96, 64, 96 // GROUP
    q = torch.randint(0, 16, (in_f, out_f), generator=gen)
    zero = torch.randint(1, 16, (groups, out_f), generator=gen)
    scales = (torch.rand(groups, out_f, generator=gen) * 0.02 + 0.001).half()
    g_idx = (torch.randperm(in_f, generator=gen) // GROUP).to(torch.int32)
    offset = 1 if fmt == "gptq" else 0
    expected = (scales.float()[g_idx.long()] * (q - zero[g_idx.long()]).float()).t()

    def update(t):
        t[f"{name}.qweight"] = _pack_rows(q.t()).t().contiguous()
        t[f"{name}.qzeros"] = _pack_rows(zero - offset)
        t[f"{name}.scales"] = scales
        t[f"{name}.g_idx"] = g_idx
        if fmt == "gptq_v2":  # every other layer's stored zeros + 1
            for key in [k for k in t if k.endswith(".qzeros") and not k.startswith(name)]:
                stored = torch.stack([(t[key] >> (4 * b)) & 15 for b in range(8)], -1).reshape(t[key].shape[0], -1)
                t[key] = _pack_rows(stored + 1)

    dst = str(tmp_path / fmt)
    _rewrite(path, dst, {"checkpoint_format": fmt, "desc_act": True, "sym": False}, update)
    loaded = load_gptq(dst, dtype=torch.float32)
    layer = loaded.get_submodule(name)
    assert layer.zero_offset == offset and layer.weight_object().group_size is None
    assert torch.equal(layer.dequantize(torch.float32), expected)
    if fmt == "gptq_v2":
        ref = load_gptq(path, dtype=torch.float32)
        other = "model.layers.0.self_attn.q_proj"
        assert torch.equal(loaded.get_submodule(other).dequantize(), ref.get_submodule(other).dequantize())


def test_missing_g_idx_uses_plain_groups(checkpoint, tmp_path):
    _, _, _, path = checkpoint
    dst = str(tmp_path / "no_gidx")
    _rewrite(path, dst, {}, lambda t: [t.pop(k) for k in [k for k in t if k.endswith(".g_idx")]])
    loaded = load_gptq(dst, dtype=torch.float32)
    ref = load_gptq(path, dtype=torch.float32)
    name = "model.layers.0.mlp.down_proj"
    assert torch.equal(loaded.get_submodule(name).g_idx, ref.get_submodule(name).g_idx)
    with pytest.raises(ValueError, match="desc_act is true but the checkpoint has no .*g_idx"):
        dst2 = str(tmp_path / "no_gidx_desc")
        _rewrite(path, dst2, {"desc_act": True}, lambda t: [t.pop(k) for k in [k for k in t if k.endswith(".g_idx")]])
        load_gptq(dst2)


@pytest.mark.parametrize("qc, tensors, message", [
    ({"bits": 8}, None, "bits is 8; foak reads 4-bit GPTQ only"),
    ({"bits": 3}, None, "bits is 3"),
    ({"checkpoint_format": "marlin"}, None, "checkpoint_format 'marlin' is not supported"),
    ({"checkpoint_format": "gptq_exllama"}, None, "not supported: foak reads the plain"),
    ({"is_marlin_format": True}, None, "marlin \\(is_marlin_format\\)"),
    ({"quant_method": "awq"}, None, "quant_method is 'awq'"),
    ({"dynamic": {"-:.*down": {}}}, None, "dynamic"),
    ({}, "missing", "missing tensors \\(1\\): model.layers.0.self_attn.k_proj.qzeros"),
    ({}, "unexpected", "no place for \\(1\\): model.layers.0.self_attn.k_proj.weight"),
    ({"group_size": 16}, None, "shape mismatches \\(group_size=16\\): model.layers.0.self_attn.q_proj.qzeros: "
                               "checkpoint \\(2, 8\\), model expects \\(4, 8\\)"),
    ({}, "dtype", "model.layers.0.self_attn.q_proj.qweight: dtype F32, expected int32"),
])
def test_loader_refuses(checkpoint, tmp_path, qc, tensors, message):
    _, _, _, path = checkpoint

    def update(t):
        if tensors == "missing":
            del t["model.layers.0.self_attn.k_proj.qzeros"]
        elif tensors == "unexpected":
            t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)
        elif tensors == "dtype":
            t["model.layers.0.self_attn.q_proj.qweight"] = t["model.layers.0.self_attn.q_proj.qweight"].float()

    dst = str(tmp_path / "bad")
    _rewrite(path, dst, qc, update)
    with pytest.raises(ValueError, match=message):
        load_gptq(dst)


def test_loader_refuses_without_quantization_config(checkpoint, tmp_path):
    _, _, _, path = checkpoint
    dst = tmp_path / "plain"
    shutil.copytree(path, dst)
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no quantization_config"):
        load_gptq(str(dst))


def test_peft_lora_on_loaded_model(checkpoint):
    import peft

    from foak.quant.gptq_peft import GPTQLoraLinear, register_gptq_lora

    _, _, _, path = checkpoint
    model = load_gptq(path, dtype=torch.float32)
    targets = ["q_proj", "v_proj", "down_proj"]
    with pytest.raises(ValueError, match="is not supported"):  # PEFT alone does not know GPTQLinear
        peft.get_peft_model(load_gptq(path, dtype=torch.float32), peft.LoraConfig(r=4, target_modules=targets))
    with torch.no_grad():
        base_logits = model(_ids()).logits
    config = register_gptq_lora(peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    pm = peft.get_peft_model(model, config)
    wrapped = [m for m in pm.modules() if isinstance(m, GPTQLoraLinear)]
    assert len(wrapped) == 6 and all(isinstance(m.base_layer, GPTQLinear) for m in wrapped)
    out = pm(_ids(), labels=_ids())
    assert not torch.allclose(out.logits, base_logits)
    out.loss.backward()
    trainable = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    assert len(trainable) == 12 and all("lora_" in n for n in trainable)
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in trainable.values())
    assert all(p.grad is None for n, p in pm.named_parameters() if not p.requires_grad)
    # the adapter math on one layer: base(x) + scaling * B(A(x))
    layer = wrapped[0]
    x = torch.randn(2, 3, layer.in_features)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    ref = x @ _dense(layer.base_layer).t() + 2.0 * (x @ a.t() @ b.t())
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot be merged"):
        layer.merge()
