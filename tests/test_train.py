import json

import pytest
import torch
import transformers

import foak
from foak.data import IGNORE_INDEX, DatasetError, PackingCollator, PaddingCollator, char_tokenizer, read_jsonl, tokenize
from foak.integrations import FoakCallback
from foak.models.tiny import tiny_model
from foak.patching import is_patched
from foak.testing import relative_error
from foak.train import train

SMALL = ["--max_steps", "4", "--per_device_train_batch_size", "2", "--max_seq_length", "16", "--logging_steps", "1",
         "--learning_rate", "1e-2", "--warmup_steps", "0"]


def test_embedded_default_trains_patched_and_saves_a_loadable_model(tmp_path, capsys):
    # 3 steps (every kernel in the interpreter): the loss goes from ~3.86 to ~3.35
    summary = train([*SMALL, "--max_steps", "3", "--output_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "No GPU" in out and "llama.fused_linear_loss" in out  # the patch report is printed
    assert summary["steps"] == 3 and summary["tokens"] > 0 and summary["tokens_per_second"] > 0
    assert summary["final_loss"] < summary["first_loss"]
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = torch.tensor([tokenizer.encode("the cat sees the ball.")])
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prompt_response_dataset_trains_on_the_response_only(tmp_path):
    data = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": "q: 1+1", "response": " 2"})] * 3)
    tokenizer = char_tokenizer()
    example = tokenize(read_jsonl(data), tokenizer, 64)[0]
    n_prompt = 1 + len("q: 1+1")  # bos + prompt characters
    assert example["labels"][:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert example["labels"][n_prompt:] == example["input_ids"][n_prompt:]


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"text": "ok"}', "{not json", '{"text": "fine"}', '{"txt": "x"}'],
         r"2 malformed line\(s\):\n  line 2: not valid JSON.*\n  line 4: expected a string field 'text'"),
        (["", "   "], "the dataset is empty"),
        (['{"prompt": "a"}'], "line 1: a prompt/response record needs string fields"),
        (['["a list"]'], "line 1: expected a JSON object"),
    ],
)
def test_bad_datasets_are_reported_with_line_numbers(tmp_path, lines, message):
    with pytest.raises(DatasetError, match=message):
        read_jsonl(_write(tmp_path / "d.jsonl", lines))


def test_missing_files_and_bad_arguments_fail_before_training(tmp_path):
    with pytest.raises(DatasetError, match="dataset file not found"):
        train(["--dataset", str(tmp_path / "nope.jsonl"), "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="no such directory"):
        train(["--model", str(tmp_path / "no-model"), "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--peft must be none, lora or qlora-nf4"):
        train(["--peft", "qlora", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--target_modules \['qkv'\] match no linear layer.*'q_proj'"):
        train([*SMALL, "--peft", "lora", "--target_modules", "qkv", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="did you mean 'fast_rms_layernorm'"):
        bad = _write(tmp_path / "foak.yaml", ["training:", "  fused_ops_and_kernels:", "    fast_rsm_layernorm: true"])
        train([*SMALL, "--acceleration_config", str(bad), "--output_dir", str(tmp_path)])


def test_overlong_sequences_are_truncated_and_counted():
    tokenizer = char_tokenizer()
    dataset = tokenize([{"text": "a" * 50}, {"text": "short"}], tokenizer, max_seq_length=16)
    assert dataset.truncated == 1 and len(dataset[0]["input_ids"]) == 16


# two steps of one 12-token row: foak's LoRA op is slow in the Triton interpreter (its dropout most of all)
TINY = ["--max_steps", "2", "--per_device_train_batch_size", "1", "--max_seq_length", "12", "--logging_steps", "1",
        "--warmup_steps", "0", "--lora_r", "4"]


def test_lora_default_config_runs_foaks_fused_lora_and_saves_an_adapter(tmp_path, capsys):
    summary = train([*TINY, "--peft", "lora", "--output_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert summary["steps"] == 2 and (tmp_path / "adapter_config.json").exists()
    # the default for a LoRA run: the peft stanza with fused_lora and every kernel of the embedded default
    for rule in ("rms_norm", "rope", "swiglu", "fused_linear_loss", "fused_lora"):
        assert out.count(f"llama.{rule} ") == 2, rule  # the report is printed before and after training
    # 7 target modules x 2 layers, one forward each per step, all on foak's op
    assert summary["fused_lora"] == {"modules": 14, "fused": 28, "peft_path": 0, "peft_path_reasons": {},
                                     "notes": "4 forwards with q/k/v as one fused LoRA block; fused 28 calls"}
    assert "after training:" in out and "fused 28 calls" in out.split("after training:")[1]
    assert "fused 28 calls" in summary["patch_report"]
    assert torch.isfinite(torch.tensor(summary["final_loss"]))


def test_lora_dropout_still_takes_the_fused_path(tmp_path):
    summary = train([*TINY, "--peft", "lora", "--lora_dropout", "0.1", "--target_modules", "q_proj",
                     "--output_dir", str(tmp_path)])
    calls = summary["fused_lora"]
    assert (calls["modules"], calls["fused"], calls["peft_path"]) == (2, 4, 0), calls
    assert torch.isfinite(torch.tensor(summary["final_loss"]))


def test_mismatched_stanza_or_unknown_architecture_with_peft_is_an_error(tmp_path):
    full = _write(tmp_path / "full.yaml", ["training:", "  fused_ops_and_kernels:", "    fast_rms_layernorm: true"])
    with pytest.raises(ValueError, match=r"--peft lora with --acceleration_config .*full fine-tuning.*"
                                         r"peft\.quantization\.fused_ops_and_kernels and add fused_lora: true"):
        train([*TINY, "--peft", "lora", "--acceleration_config", str(full), "--output_dir", str(tmp_path)])
    peft_stanza = _write(tmp_path / "peft.yaml", ["peft:", "  quantization:", "    fused_ops_and_kernels:",
                                                  "      fused_lora: true"])
    with pytest.raises(ValueError, match=r"has the peft\.quantization\.fused_ops_and_kernels stanza .* --peft is none"):
        train([*TINY, "--acceleration_config", str(peft_stanza), "--output_dir", str(tmp_path)])
    # a model foak has no rules for: the default LoRA config says how to train it without foak
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64))
    gpt2.save_pretrained(tmp_path / "gpt2")
    char_tokenizer().save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="no kernels for model_type 'gpt2'.*--acceleration_config none"):
        train([*TINY, "--model", str(tmp_path / "gpt2"), "--peft", "lora", "--target_modules", "c_attn",
               "--output_dir", str(tmp_path)])


def test_qlora_nf4_quantizes_the_embedded_model_and_trains_with_the_default_config(tmp_path):
    import bitsandbytes as bnb

    from foak.train import load_model_and_tokenizer, parse_arguments

    model, _, name = load_model_and_tokenizer(*parse_arguments(["--peft", "qlora-nf4", "--output_dir", str(tmp_path)]))
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 14 and "NF4" in name
    assert all(m.weight.quant_state.quant_type == "nf4" and m.weight.dtype == torch.uint8 for m in quantized)
    summary = train([*TINY, "--peft", "qlora-nf4", "--output_dir", str(tmp_path)])
    assert summary["steps"] == 2 and torch.isfinite(torch.tensor(summary["final_loss"]))
    assert (tmp_path / "adapter_config.json").exists()
    counts = summary["fused_lora"]
    assert counts["modules"] == 14 and "14 bitsandbytes NF4 Linear4bit" in counts["notes"], counts
    # 2 steps x 14 layers, each forward twice (qlora-nf4 turns on gradient checkpointing unless told not to)
    assert counts["fused"] == 2 * 14 * 2 and counts["peft_path"] == 0, counts
    assert summary["gradient_checkpointing"] is True


def test_gradient_checkpointing_follows_the_users_choice(tmp_path):
    from foak.train import parse_arguments

    def checkpointing(*argv):
        return parse_arguments(list(argv))[1].gradient_checkpointing

    # not given: on for qlora-nf4 only; given (either name, either spelling, with or without a value): the user's
    assert checkpointing("--peft", "qlora-nf4") is True and checkpointing("--peft", "lora") is False
    assert checkpointing("--peft", "qlora-nf4", "--gradient_checkpointing", "false") is False
    assert checkpointing("--peft", "qlora-nf4", "--activation-checkpointing=no") is False
    assert checkpointing("--peft", "lora", "--gradient-checkpointing") is True
    foak.set_backend("reference")  # the flag is under test, not the kernels
    try:
        off = train([*TINY, "--peft", "qlora-nf4", "--gradient_checkpointing", "false", "--output_dir", str(tmp_path)])
        on = train([*TINY, "--peft", "lora", "--gradient_checkpointing", "--output_dir", str(tmp_path)])
    finally:
        foak.set_backend("auto")
    # 2 steps x 14 LoRA layers: one forward each without checkpointing, two with it
    assert off["gradient_checkpointing"] is False and off["fused_lora"]["fused"] == 2 * 14, off["fused_lora"]
    assert on["gradient_checkpointing"] is True and on["fused_lora"]["fused"] == 2 * 14 * 2, on["fused_lora"]


def _examples():
    tokenizer = char_tokenizer()
    texts = ["the cat sees the ball.", "a dog eats.", "1 2 3 4 5.", "we sail."]  # short: interpreter time
    return tokenize([{"text": t} for t in texts], tokenizer, 64), tokenizer


def _one_step(batch_size, accumulation, tmp_path, patch):
    dataset, tokenizer = _examples()
    model = tiny_model("llama")
    model.resize_token_embeddings(len(tokenizer))
    if patch:  # the loss is what takes num_items_in_batch (the RMSNorm kernel ran here too, at 2/3 of the time)
        foak.patch(model, fused_linear_loss=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
        max_steps=1, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", report_to="none",
        save_strategy="no", seed=3, max_grad_norm=1e9)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset,
                                   data_collator=PaddingCollator(tokenizer.pad_token_id))
    trainer.train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_gradient_accumulation_equals_one_large_batch(tmp_path):
    # batch 4 x accumulation 1 and batch 1 x accumulation 4 take the same SGD step with foak's loss
    # (num_items_in_batch), also against the unpatched model
    big = _one_step(4, 1, tmp_path, patch=True)
    accumulated = _one_step(1, 4, tmp_path, patch=True)
    unpatched = _one_step(1, 4, tmp_path, patch=False)
    start = {n: p.detach() for n, p in tiny_model("llama").named_parameters()}
    for name, p in big.items():
        if name in start and start[name].shape == p.shape:
            step = p - start[name]
            assert relative_error(accumulated[name] - start[name], step) < 1e-5, name
            assert relative_error(unpatched[name] - start[name], step) < 1e-5, name


def test_foak_callback_patches_the_trainers_model(tmp_path):
    dataset, tokenizer = _examples()
    model = tiny_model("llama")
    model.resize_token_embeddings(len(tokenizer))
    callback = FoakCallback(fast_rms_layernorm=True, fused_linear_loss=True)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none",
                                          save_strategy="no", per_device_train_batch_size=2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback],
                                   data_collator=PaddingCollator(tokenizer.pad_token_id))
    assert is_patched(model) and callback.report.count("llama.rms_norm") == 5
    assert torch.isfinite(torch.tensor(trainer.train().training_loss))


def test_packing_restarts_positions_and_matches_separate_sequences():
    dataset, _ = _examples()
    features = [dataset[i] for i in range(3)]
    packed = PackingCollator()(features)
    lengths = [len(f["input_ids"]) for f in features]
    assert packed["input_ids"].shape == (1, sum(lengths)) and "attention_mask" not in packed
    assert packed["position_ids"][0].tolist() == [i for n in lengths for i in range(n)]
    model = tiny_model("llama")
    model.resize_token_embeddings(64)
    packed_loss = model(**packed).loss
    # per-sequence losses, weighted by their trained tokens: the same mean as the packed row
    total, count = 0.0, 0
    for f in features:
        ids = torch.tensor([f["input_ids"]])
        n = len(f["input_ids"]) - 1
        total = total + model(input_ids=ids, labels=ids).loss * n
        count += n
    assert relative_error(packed_loss, total / count) < 1e-5


def test_packed_training_runs_the_packed_attention(tmp_path):
    # the default config: the kernels (interpreter) and fast_packed_attention on the packed rows
    summary = train([*SMALL, "--max_steps", "2", "--packing", "--output_dir", str(tmp_path)])
    assert summary["steps"] == 2 and summary["tokens"] > 0
    # 2 steps x 2 layers, each batch's sequences in one row
    assert "foak varlen attention ran 4 calls (sdpa 4)" in summary["patch_report"]
    assert "previous implementation" not in summary["patch_report"]
    assert "llama.rope " in summary["patch_report"]
    assert torch.isfinite(torch.tensor(summary["final_loss"]))


def test_qlora_nf4_with_kernels_saves_an_adapter(tmp_path):
    model_dir, data = tmp_path / "tiny", tmp_path / "d.jsonl"
    tokenizer = char_tokenizer()
    model = tiny_model("llama")
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    _write(data, [json.dumps({"prompt": "q: the cat", "response": " sees the ball."})] * 8)
    config = _write(tmp_path / "foak.yaml", ["peft:", "  quantization:", "    fused_ops_and_kernels:",
                                             "      fast_rms_layernorm: true", "      fused_linear_loss: true"])
    summary = train(["--model", str(model_dir), "--dataset", str(data), "--peft", "qlora-nf4", "--lora_r", "4",
                     "--max_steps", "2", "--per_device_train_batch_size", "2", "--acceleration_config", str(config),
                     "--output_dir", str(tmp_path / "out")])
    assert summary["steps"] == 2 and torch.isfinite(torch.tensor(summary["final_loss"]))
    assert (tmp_path / "out" / "adapter_config.json").exists()


def test_arch_picks_the_embedded_model_and_bad_arch_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="no embedded tiny model of that type; choose one of .*qwen3_moe"):
        train(["--arch", "nope", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="with --model the model's own config decides it: drop --arch"):
        train(["--arch", "qwen3", "--model", str(tmp_path), "--output_dir", str(tmp_path)])


@pytest.mark.parametrize("arch", sorted(__import__("foak.models.tiny", fromlist=["TINY_CONFIGS"]).TINY_CONFIGS))
def test_embedded_default_of_every_architecture_trains(arch, tmp_path, reference_ops):
    """``foak train --arch T``: the tiny model of each type foak serves trains patched (foak's reference ops:
    the kernels have their own tests) and its report names the type's rules."""
    summary = train([*SMALL, "--max_steps", "2", "--arch", arch, "--output_dir", str(tmp_path),
                     "--save_strategy", "no"])
    assert summary["steps"] == 2 and all(map(lambda x: x == x, (summary["first_loss"], summary["final_loss"])))
    assert f"{arch}.fused_linear_loss" in summary["patch_report"] or f"{arch}.loss" in summary["patch_report"]
    assert type(summary["model"]).__name__ == type(tiny_model(arch)).__name__


def test_long_context_preset(tmp_path, reference_ops):
    """--long_context: checkpointing on and the long-context switches on top of foak's defaults (the offload row
    says every checkpointed layer's input went to CPU memory); it refuses a run without checkpointing and a
    YAML (whose switches it would otherwise override)."""
    summary = train([*SMALL, "--max_steps", "2", "--long_context", "--output_dir", str(tmp_path),
                     "--save_strategy", "no"])
    assert summary["gradient_checkpointing"] is True
    assert "offload_activations" in summary["patch_report"] and "2 of 2 checkpointed layers" in summary["patch_report"]
    with pytest.raises(ValueError, match="--long_context needs gradient checkpointing"):
        train(["--long_context", "--gradient_checkpointing", "false", "--output_dir", str(tmp_path)])
    yaml_file = tmp_path / "k.yaml"
    yaml_file.write_text("training:\n  fused_ops_and_kernels:\n    fast_rms_layernorm: true\n")
    with pytest.raises(ValueError, match="put them in the YAML instead"):
        train(["--long_context", "--acceleration_config", str(yaml_file), "--output_dir", str(tmp_path)])


def test_default_lora_targets_exist_on_every_architecture(tmp_path, reference_ops):
    """The default LoRA targets are the default names each model has as linear layers (an MoE model's experts
    are 3-D parameters; MLA has its own projections), never empty, never a name the model lacks; a LoRA run on
    MoE models with the defaults trains."""
    from torch import nn

    from foak.models.tiny import TINY_CONFIGS
    from foak.train import DEFAULT_TARGETS, default_targets

    def names(model):
        return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)} - {"lm_head"}

    for arch in TINY_CONFIGS:
        linear = names(tiny_model(arch))
        targets = default_targets(linear)
        assert targets and set(targets) <= linear, (arch, targets, linear)
    assert default_targets(names(tiny_model("mixtral"))) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert default_targets(names(tiny_model("deepseek_v3")))[:4] == ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                                   "kv_b_proj"]
    assert default_targets(names(tiny_model("llama"))) == DEFAULT_TARGETS
    for arch in ("mixtral", "deepseek_v3"):
        summary = train([*SMALL, "--max_steps", "1", "--arch", arch, "--peft", "lora", "--output_dir",
                         str(tmp_path / arch), "--save_strategy", "no"])
        assert summary["steps"] == 1 and f"{arch}.fused_lora" in summary["patch_report"]


def test_max_seq_length_default_comes_from_the_model():
    """No --max_seq_length: the model's context length (or the tokenizer's, if shorter), capped at 4096 unless
    --long_context; stated. A non-positive value is a one-line error."""
    from foak.train import MAX_SEQ_LENGTH_CAP, default_max_seq_length, parse_arguments

    model = tiny_model("llama")  # max_position_embeddings 128
    tok = type("Tok", (), {"model_max_length": int(1e30)})()  # transformers' "no limit" value
    assert default_max_seq_length(model, tok, False) == (128, "the model's context length, 128")
    tok.model_max_length = 96
    assert default_max_seq_length(model, tok, False)[0] == 96
    model.config.max_position_embeddings, tok.model_max_length = 131072, int(1e30)
    n, how = default_max_seq_length(model, tok, False)
    assert n == MAX_SEQ_LENGTH_CAP == 4096 and "capped at 4096" in how
    assert default_max_seq_length(model, tok, True)[0] == 131072  # --long_context: not capped
    assert parse_arguments([])[0].max_seq_length is None  # decided once the model is loaded
    with pytest.raises(ValueError, match="--max_seq_length must be a positive number of tokens, got 0"):
        parse_arguments(["--max_seq_length", "0"])
