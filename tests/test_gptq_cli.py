"""foak train and foak verify on a GPTQ checkpoint directory: a tiny Llama quantized by foak's round-to-nearest
GPTQ quantizer and written by save_gptq (with a character tokenizer), loaded through foak.quant.load_gptq."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from foak.cli import main
from foak.data import char_tokenizer
from foak.models.tiny import tiny_model
from foak.quant import load_gptq, quantize_model_gptq, save_gptq
from foak.train import train

TINY = ["--max_steps", "2", "--per_device_train_batch_size", "1", "--max_seq_length", "12", "--logging_steps", "1",
        "--warmup_steps", "0", "--lora_r", "4"]


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gptq_cli")
    save_gptq(quantize_model_gptq(tiny_model("llama"), group_size=32), path, tokenizer=char_tokenizer())
    return path


def test_train_lora_on_a_gptq_checkpoint_runs_fused_lora_and_saves_an_adapter(gptq_dir, tmp_path, capsys):
    out_dir = tmp_path / "out"
    summary = train([*TINY, "--model", str(gptq_dir), "--peft", "lora", "--output_dir", str(out_dir)])
    out = capsys.readouterr().out
    assert f"model: {gptq_dir} (GPTQ 4-bit checkpoint, group_size 32, loaded by foak.quant.load_gptq" in out
    counts = summary["fused_lora"]
    # 7 targets x 2 layers over GPTQ bases, one forward each per step, all on foak's fused op
    assert (counts["modules"], counts["fused"], counts["peft_path"]) == (14, 14 * 2, 0), counts
    assert "14 foak GPTQ-4bit GPTQLinear" in counts["notes"], counts
    after = out.split("after training:")[1]
    assert "llama.fused_lora" in after and "foak GPTQ-4bit GPTQLinear" in after and "fused 28 calls" in after
    assert summary["steps"] == 2 and torch.isfinite(torch.tensor(summary["final_loss"]))
    adapter = load_file(out_dir / "adapter_model.safetensors")
    assert (out_dir / "adapter_config.json").exists()
    assert len(adapter) == 14 * 2 and all("lora_A" in k or "lora_B" in k for k in adapter), sorted(adapter)
    # lora_B starts at zero: after two steps it has moved in every layer
    assert all(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)
    # what load_gptq(out_dir) needs beside the adapter: the base and the dtype it trained in
    record = json.loads((out_dir / "foak_gptq_base.json").read_text())
    assert (record["base_model_name_or_path"], record["dtype"]) == (str(gptq_dir), "float32"), record
    assert record["quantization_config"]["group_size"] == 32
    reloaded = load_gptq(out_dir)
    assert next(reloaded.parameters()).dtype == torch.float32
    for name, tensor in adapter.items():  # PEFT's saved names lack the adapter name
        loaded = reloaded.get_parameter(name.replace(".weight", ".default.weight"))
        assert torch.equal(loaded, tensor), name
    # a directory without an adapter, and an adapter whose recorded base has moved: one-line errors
    with pytest.raises(ValueError, match=r"adapter .* has no adapter_config.json"):
        load_gptq(gptq_dir, adapter=tmp_path)
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (moved / name).write_bytes((out_dir / name).read_bytes())
    (moved / "foak_gptq_base.json").write_text(json.dumps({**record, "base_model_name_or_path": str(tmp_path / "x")}))
    with pytest.raises(ValueError, match=r"the base model .*/x that .* is not a directory .*load_gptq\(<gptq dir>"):
        load_gptq(moved)


def test_gptq_checkpoint_without_lora_is_an_error(gptq_dir, tmp_path):
    with pytest.raises(ValueError, match=r"GPTQ 4-bit checkpoint.*cannot be fully fine-tuned; pass --peft lora"):
        train([*TINY, "--model", str(gptq_dir), "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"GPTQ 4-bit checkpoint, already quantized: --peft qlora-nf4.*--peft lora"):
        train([*TINY, "--model", str(gptq_dir), "--peft", "qlora-nf4", "--output_dir", str(tmp_path)])


def test_verify_on_a_gptq_checkpoint_compares_the_trainable_gradients(gptq_dir, capsys):
    # the rules that meet the GPTQ layers (the MLP over GPTQ projections, LoRA adapters over them); every GPTQ
    # forward and backward dequantizes in the interpreter, so the default (all rules) is left to the CLI
    assert main(["verify", "--model", str(gptq_dir), "--rules", "swiglu", "lora"]) == 0
    out = capsys.readouterr().out
    assert "GPTQ 4-bit checkpoint, group_size 32, loaded by foak.quant.load_gptq" in out
    # 14 frozen GPTQ layers; compared: embeddings, 2 x 2 layer norms, final norm, lm_head
    assert "its 14 GPTQLinear layers hold frozen 4-bit weights" in out and "the 7 trainable parameters" in out
    assert "verify: PASS: 3 of 3 checks passed; 7 rules not checked: " in out, out
    for row in ("swiglu ", "lora ", "all: lora, swiglu "):
        assert f"\n{row}" in out, row
    # fused_lora ran on the 14 GPTQLoraLinear layers, alone and with the other rules
    assert out.count("lora 14/14") == 2, out
