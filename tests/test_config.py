import re
import textwrap

import pytest
import torch
from pydantic import ValidationError

from foak.config import (
    FULL_STANZA,
    PEFT_STANZA,
    SWITCH_TO_RULE,
    AccelerationConfig,
    check_precision,
    config_from_kwargs,
    load_config,
)

SWITCHES = [
    "fast_rms_layernorm",
    "fast_rope_embeddings",
    "fast_swiglu",
    "fast_loss",
    "fused_linear_loss",
    "fused_lora",
    "fast_moe",
    "fast_packed_attention",
]


def training(**switches):
    return {"training": {"fused_ops_and_kernels": switches}}


def peft(**switches):
    return {"peft": {"quantization": {"fused_ops_and_kernels": switches}}}


def error_of(source):
    with pytest.raises(ValueError) as info:
        load_config(source)
    return str(info.value)


def write(tmp_path, text, name="accel.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ---------------------------------------------------------------- stanzas


def test_training_stanza_alone_loads():
    cfg = load_config(training(fast_rms_layernorm=True, fused_linear_loss=True))
    assert cfg.mode == "full"
    assert cfg.stanza_path == FULL_STANZA == "training.fused_ops_and_kernels"
    assert cfg.fast_rms_layernorm is True and cfg.fused_linear_loss is True
    assert cfg.fast_rope_embeddings is False and cfg.fast_loss is False and cfg.fused_lora is False
    assert cfg.base_layer == "none"
    assert cfg.enabled_rules() == {"rms_norm", "fused_linear_loss"}


def test_peft_stanza_alone_loads():
    cfg = load_config(peft(fused_lora=True, base_layer="bitsandbytes", fast_rope_embeddings=True))
    assert cfg.mode == "peft"
    assert cfg.stanza_path == PEFT_STANZA == "peft.quantization.fused_ops_and_kernels"
    assert cfg.fused_lora is True and cfg.base_layer == "bitsandbytes" and cfg.fast_rope_embeddings is True
    assert cfg.fast_rms_layernorm is False
    assert cfg.enabled_rules() == {"lora", "rope"}


@pytest.mark.parametrize("base_layer", ["none", "bitsandbytes", "gptq"])
def test_peft_base_layers(base_layer):
    assert load_config(peft(base_layer=base_layer)).base_layer == base_layer


@pytest.mark.parametrize("doc,mode", [(training(), "full"), (peft(), "peft")])
def test_empty_stanza_activates_with_everything_off(doc, mode):
    cfg = load_config(doc)
    assert cfg.mode == mode
    assert cfg.enabled_rules() == set()
    assert cfg.base_layer == "none"


def test_null_stanza_is_an_empty_stanza(tmp_path):
    path = write(tmp_path, "training:\n  fused_ops_and_kernels:\n")
    cfg = load_config(path)
    assert cfg.mode == "full" and cfg.enabled_rules() == set()


def test_both_stanzas_is_an_error():
    msg = error_of({**training(fast_rms_layernorm=True), **peft(fused_lora=True)})
    assert "both" in msg and FULL_STANZA in msg and PEFT_STANZA in msg
    assert "exactly one must be used" in msg
    assert "full fine-tuning" in msg and "LoRA/QLoRA" in msg


def test_both_empty_stanzas_is_still_an_error():
    msg = error_of(
        {"training": {"fused_ops_and_kernels": None}, "peft": {"quantization": {"fused_ops_and_kernels": {}}}}
    )
    assert "exactly one must be used" in msg


@pytest.mark.parametrize("doc", [{}, {"training": {}}, {"peft": {"quantization": {}}}, {"peft": {}, "training": {}}])
def test_no_stanza_is_an_error_naming_both_paths(doc):
    msg = error_of(doc)
    assert msg.startswith("no foak stanza")
    assert FULL_STANZA in msg and PEFT_STANZA in msg


# ---------------------------------------------------------------- unknown keys


def test_top_level_typo_suggests_training():
    msg = error_of({"trainig": {"fused_ops_and_kernels": {"fast_loss": True}}})
    assert "unknown key 'trainig' at the top level; did you mean 'training'?" in msg


def test_stanza_level_typo_suggests_fused_ops_and_kernels():
    msg = error_of({"training": {"fused_ops_and_kernel": {"fast_loss": True}}})
    assert "unknown key 'fused_ops_and_kernel' in training; did you mean 'fused_ops_and_kernels'?" in msg


def test_peft_intermediate_level_typo():
    msg = error_of({"peft": {"quantisation": {"fused_ops_and_kernels": {}}}})
    assert "unknown key 'quantisation' in peft; did you mean 'quantization'?" in msg
    msg = error_of({"peft": {"quantization": {"fused_ops_and_kernles": {}}}})
    assert "unknown key 'fused_ops_and_kernles' in peft.quantization; did you mean 'fused_ops_and_kernels'?" in msg


def test_switch_level_typo_suggests_the_switch():
    msg = error_of(training(fast_rsm_layernorm=True))
    assert msg.startswith(
        "unknown key 'fast_rsm_layernorm' in training.fused_ops_and_kernels; did you mean 'fast_rms_layernorm'?"
    )
    msg = error_of(peft(fused_lroa=True))
    assert msg.startswith(
        "unknown key 'fused_lroa' in peft.quantization.fused_ops_and_kernels; did you mean 'fused_lora'?"
    )
    msg = error_of(training(base_layers="none"))
    assert "did you mean 'base_layer'?" in msg


def test_sibling_keys_are_rejected():
    msg = error_of({**training(), "model_name_or_path": "x"})
    assert "unknown key 'model_name_or_path' at the top level; valid keys here: training, peft" == msg
    msg = error_of({"training": {"fused_ops_and_kernels": {}, "learning_rate": 1e-4}})
    assert "unknown key 'learning_rate' in training" in msg and "fused_ops_and_kernels" in msg
    msg = error_of({"peft": {"quantization": {"fused_ops_and_kernels": {}}, "lora": {"r": 8}}})
    assert "unknown key 'lora' in peft" in msg


def test_misplaced_key_names_its_full_path():
    msg = error_of({"fast_loss": True})
    assert "unknown key 'fast_loss' at the top level" in msg
    assert "'training.fused_ops_and_kernels.fast_loss'" in msg
    assert "'peft.quantization.fused_ops_and_kernels.fast_loss'" in msg
    msg = error_of({"peft": {"fused_ops_and_kernels": {}}})
    assert "unknown key 'fused_ops_and_kernels' in peft" in msg
    assert "did you mean 'peft.quantization.fused_ops_and_kernels'" in msg  # same branch named first


def test_mode_is_not_a_yaml_key():
    msg = error_of(training(mode="peft"))
    assert "unknown key 'mode' in training.fused_ops_and_kernels" in msg


def test_every_unknown_key_is_reported_at_once():
    msg = error_of({"trainig": {}, "peft": {"quantization": {"fused_ops_and_kernels": {"fast_rsm_layernorm": True}}}})
    lines = msg.splitlines()
    assert len(lines) == 2
    assert "did you mean 'training'?" in lines[0]
    assert "did you mean 'fast_rms_layernorm'?" in lines[1]


# ---------------------------------------------------------------- value types and combinations


@pytest.mark.parametrize("value", ["yes", "true", 1, 0, None, 1.0])
def test_bool_switch_rejects_non_bool(value):
    msg = error_of(training(fast_loss=value))
    assert msg == (
        f"training.fused_ops_and_kernels.fast_loss: expected a boolean (true or false), "
        f"got {type(value).__name__} {value!r}"
    )


def test_base_layer_rejects_unknown_value():
    msg = error_of(peft(base_layer="nf4"))
    assert msg == (
        "peft.quantization.fused_ops_and_kernels.base_layer: expected one of 'none', 'bitsandbytes', 'gptq', "
        "got str 'nf4'"
    )
    assert "expected one of 'none', 'bitsandbytes', 'gptq', got bool True" in error_of(peft(base_layer=True))


def test_several_type_errors_are_reported_together():
    lines = error_of(peft(fast_swiglu="on", fast_moe=2)).splitlines()
    assert len(lines) == 2
    assert any(
        line.startswith("peft.quantization.fused_ops_and_kernels.fast_swiglu: expected a boolean") for line in lines
    )
    assert any(
        line.startswith("peft.quantization.fused_ops_and_kernels.fast_moe: expected a boolean") for line in lines
    )


def test_yaml_boolean_spellings(tmp_path):
    # PyYAML reads YAML 1.1 booleans (true/True/yes/on); a quoted "yes" is a string and is rejected.
    cfg = load_config(
        write(tmp_path, "training:\n  fused_ops_and_kernels:\n    fast_swiglu: yes\n    fast_moe: True\n")
    )
    assert cfg.fast_swiglu is True and cfg.fast_moe is True
    msg = error_of(write(tmp_path, 'training:\n  fused_ops_and_kernels:\n    fast_loss: "yes"\n', "quoted.yaml"))
    assert msg == "training.fused_ops_and_kernels.fast_loss: expected a boolean (true or false), got str 'yes'"


@pytest.mark.parametrize(
    "doc", [{"training": {"fused_ops_and_kernels": [1]}}, {"training": {"fused_ops_and_kernels": "x"}}]
)
def test_stanza_must_be_a_mapping(doc):
    assert error_of(doc).startswith("training.fused_ops_and_kernels must be a mapping of switches, got ")


def test_intermediate_node_must_be_a_mapping():
    assert error_of({"training": 3}) == "training must be a mapping containing 'fused_ops_and_kernels', got int 3"
    assert error_of({"peft": None}).startswith("peft must be a mapping containing 'quantization', got null")


@pytest.mark.parametrize("make", [training, peft])
def test_fast_loss_and_fused_linear_loss_conflict(make):
    msg = error_of(make(fast_loss=True, fused_linear_loss=True))
    assert "fast_loss and fused_linear_loss are both true" in msg
    assert "pick one" in msg
    with pytest.raises(ValueError, match="pick one"):
        config_from_kwargs(fast_loss=True, fused_linear_loss=True)
    # either one alone is fine
    assert load_config(make(fast_loss=True)).enabled_rules() == {"loss"}
    assert load_config(make(fused_linear_loss=True)).enabled_rules() == {"fused_linear_loss"}


@pytest.mark.parametrize("base_layer", ["bitsandbytes", "gptq"])
def test_quantized_base_layer_in_training_is_an_error(base_layer):
    msg = error_of(training(base_layer=base_layer))
    assert f"base_layer: {base_layer} in training.fused_ops_and_kernels" in msg
    assert "full fine-tuning has no LoRA adapters / quantized base" in msg
    assert PEFT_STANZA in msg  # says where to put it instead


def test_fused_lora_in_training_is_an_error():
    msg = error_of(training(fused_lora=True))
    assert "fused_lora: true in training.fused_ops_and_kernels" in msg
    assert "full fine-tuning has no LoRA adapters / quantized base" in msg
    # explicit defaults are fine in the training stanza
    cfg = load_config(training(fused_lora=False, base_layer="none"))
    assert cfg.fused_lora is False and cfg.base_layer == "none"


# ---------------------------------------------------------------- enabled_rules


def test_switch_to_rule_mapping():
    assert SWITCH_TO_RULE == {
        "fast_rms_layernorm": "rms_norm",
        "fast_rope_embeddings": "rope",
        "fast_swiglu": "swiglu",
        "fast_loss": "loss",
        "fused_linear_loss": "fused_linear_loss",
        "fused_lora": "lora",
        "fast_moe": "moe",
        "fast_packed_attention": "packed_attention",
        "offload_activations": "offload_activations",
        "tiled_mlp": "tiled_mlp",
    }


@pytest.mark.parametrize("switch", SWITCHES)
def test_each_switch_enables_exactly_its_rule(switch):
    cfg = config_from_kwargs(mode="peft", **{switch: True})
    assert cfg.enabled_rules() == {SWITCH_TO_RULE[switch]}


def test_all_rules_enabled():
    cfg = config_from_kwargs(mode="peft", base_layer="gptq", **{s: True for s in SWITCHES if s != "fast_loss"})
    assert cfg.enabled_rules() == {"rms_norm", "rope", "swiglu", "fused_linear_loss", "lora", "moe", "packed_attention"}
    cfg = config_from_kwargs(mode="peft", **{s: True for s in SWITCHES if s != "fused_linear_loss"})
    assert cfg.enabled_rules() == {"rms_norm", "rope", "swiglu", "loss", "lora", "moe", "packed_attention"}


def test_base_layer_is_not_a_rule():
    assert config_from_kwargs(mode="peft", base_layer="bitsandbytes").enabled_rules() == set()


# ---------------------------------------------------------------- constructors


def test_yaml_file_str_and_path(tmp_path):
    path = write(
        tmp_path,
        """\
        # full fine-tuning with the fused kernels
        training:
          fused_ops_and_kernels:
            fast_rms_layernorm: true
            fast_rope_embeddings: true
            fast_swiglu: true
            fused_linear_loss: true
        """,
    )
    for source in (path, str(path)):
        cfg = load_config(source)
        assert cfg.mode == "full"
        assert cfg.enabled_rules() == {"rms_norm", "rope", "swiglu", "fused_linear_loss"}


def test_peft_yaml_file(tmp_path):
    path = write(
        tmp_path,
        """\
        peft:
          quantization:
            fused_ops_and_kernels:
              fused_lora: true
              base_layer: gptq
              fast_loss: true
        """,
    )
    cfg = load_config(path)
    assert (cfg.mode, cfg.base_layer, cfg.enabled_rules()) == ("peft", "gptq", {"lora", "loss"})


def test_errors_in_a_file_name_the_file(tmp_path):
    path = write(tmp_path, "training: {}\n")
    msg = error_of(path)
    assert msg.startswith(f"no foak stanza in config file {str(path)!r}")
    path = write(tmp_path, "training: {}\npeft: {quantization: {fused_ops_and_kernels: {}}}\ntraining2: 1\n", "b.yaml")
    assert "did you mean 'training'?" in error_of(path)


def test_dict_and_config_passthrough():
    cfg = load_config(training(fast_swiglu=True))
    assert load_config(cfg) is cfg
    assert cfg == config_from_kwargs(fast_swiglu=True)


def test_kwargs_constructor():
    cfg = config_from_kwargs(fast_rms_layernorm=True, fast_loss=True)
    assert cfg.mode == "full" and cfg.enabled_rules() == {"rms_norm", "loss"}
    cfg = config_from_kwargs(mode="peft", fused_lora=True, base_layer="bitsandbytes")
    assert cfg.mode == "peft" and cfg.base_layer == "bitsandbytes" and cfg.enabled_rules() == {"lora"}
    cfg = config_from_kwargs()
    assert cfg.mode == "full" and cfg.enabled_rules() == set()


def test_kwargs_constructor_errors():
    with pytest.raises(ValueError) as info:
        config_from_kwargs(fast_rsm_layernorm=True)
    assert str(info.value).startswith(
        "unknown key 'fast_rsm_layernorm' in training.fused_ops_and_kernels; did you mean 'fast_rms_layernorm'?"
    )
    with pytest.raises(ValueError, match="full fine-tuning has no LoRA adapters"):
        config_from_kwargs(fused_lora=True)
    with pytest.raises(ValueError, match=re.escape("fast_swiglu: expected a boolean (true or false), got int 1")):
        config_from_kwargs(mode="peft", fast_swiglu=1)
    with pytest.raises(ValueError, match="mode must be 'full' .* or 'peft' .* got 'lora'"):
        config_from_kwargs(mode="lora")


@pytest.mark.parametrize(
    "cfg",
    [
        config_from_kwargs(fast_rms_layernorm=True, fused_linear_loss=True),
        config_from_kwargs(mode="peft", fused_lora=True, base_layer="gptq", fast_moe=True),
    ],
)
def test_to_yaml_dict_round_trips(cfg):
    doc = cfg.to_yaml_dict()
    assert list(doc) == [cfg.stanza_path.split(".")[0]]
    assert load_config(doc) == cfg


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="did you mean 'fast_loss'"):
        AccelerationConfig(mode="full", fast_los=True)
    with pytest.raises(ValidationError, match="valid boolean"):
        AccelerationConfig(mode="full", fast_loss="yes")
    with pytest.raises(ValueError, match="full fine-tuning has no LoRA adapters"):
        AccelerationConfig(mode="full", base_layer="gptq")
    with pytest.raises(ValueError, match="pick one"):
        AccelerationConfig(mode="peft", fast_loss=True, fused_linear_loss=True)


def test_config_is_immutable():
    cfg = config_from_kwargs(fast_loss=True)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.fused_linear_loss = True
    assert cfg.fused_linear_loss is False


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_empty_file_is_an_error(tmp_path, text):
    path = write(tmp_path, text)
    msg = error_of(path)
    assert msg.startswith(f"config file {str(path)!r} is empty")
    assert FULL_STANZA in msg and PEFT_STANZA in msg


def test_file_not_holding_a_mapping(tmp_path):
    msg = error_of(write(tmp_path, "- training\n- peft\n"))
    assert "must hold a mapping" in msg and "got list" in msg


def test_invalid_yaml(tmp_path):
    msg = error_of(write(tmp_path, "training: [unclosed\n"))
    assert "is not valid YAML" in msg


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    for source in (missing, str(missing)):
        with pytest.raises(ValueError) as info:
            load_config(source)
        assert str(info.value) == f"no such config file: {str(missing)!r}"
        assert isinstance(info.value, FileNotFoundError)


def test_yaml_text_is_not_accepted():
    text = "training:\n  fused_ops_and_kernels:\n    fast_loss: true\n"
    msg = error_of(text)
    assert msg.startswith("no such config file: ")
    assert "does not accept YAML text" in msg


def test_directory_is_not_a_config_file(tmp_path):
    assert error_of(tmp_path) == f"{str(tmp_path)!r} is a directory, not a config file"


def test_wrong_source_type():
    with pytest.raises(TypeError, match="config_from_kwargs"):
        load_config(42)


# ---------------------------------------------------------------- mixed-precision matrix

F32, B16, F16 = torch.float32, torch.bfloat16, torch.float16
FORBIDDEN_BF16_FP16 = ("fp16 autocast + GradScaler on bf16 weights", "Use mixed_precision='bf16'")
FORBIDDEN_FP16_FULL = ("Attempting to unscale FP16 gradients", "Load the model in fp32")
FORBIDDEN_FP16_PEFT = ("fp16 base weights with PEFT need mixed_precision='fp16'", "Use mixed_precision='fp16'")

# (weights, mixed_precision, peft) -> None (allowed) or the substrings the error must contain
MATRIX = {
    **{(F32, mp, p): None for mp in ("no", "fp16", "bf16") for p in (False, True)},
    (B16, "no", False): None,
    (B16, "no", True): None,
    (B16, "bf16", False): None,
    (B16, "bf16", True): None,
    (B16, "fp16", False): FORBIDDEN_BF16_FP16,
    (B16, "fp16", True): FORBIDDEN_BF16_FP16,
    (F16, "no", False): FORBIDDEN_FP16_FULL,
    (F16, "fp16", False): FORBIDDEN_FP16_FULL,
    (F16, "bf16", False): FORBIDDEN_FP16_FULL,
    (F16, "fp16", True): None,
    (F16, "no", True): FORBIDDEN_FP16_PEFT + ("without mixed precision",),
    (F16, "bf16", True): FORBIDDEN_FP16_PEFT + ("mixes two 16-bit formats",),
}


def test_matrix_covers_every_cell():
    assert len(MATRIX) == 3 * 3 * 2


@pytest.mark.parametrize("weights,mixed_precision,peft", list(MATRIX), ids=lambda v: str(v).replace("torch.", ""))
def test_precision_matrix(weights, mixed_precision, peft):
    expected = MATRIX[(weights, mixed_precision, peft)]
    if expected is None:
        assert check_precision(weights, mixed_precision, peft) is None
        return
    with pytest.raises(ValueError) as info:
        check_precision(weights, mixed_precision, peft)
    msg = str(info.value)
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"
    assert "compatibility matrix" in msg


def test_precision_matrix_docstring_has_the_table():
    doc = check_precision.__doc__
    rows = {
        "fp32, full or PEFT": ["ok", "ok", "ok"],
        "bf16, full or PEFT": ["ok", "error", "ok"],
        "fp16, full fine-tuning": ["error", "error", "error"],
        "fp16, PEFT": ["error", "ok", "error"],
    }
    for label, cells in rows.items():
        line = next(line for line in doc.splitlines() if line.strip().startswith(label))
        assert line.split()[-3:] == cells
        # the docstring table agrees with the behaviour
        weights = {"fp32": F32, "bf16": B16, "fp16": F16}[label[:4]]
        for mp, cell in zip(("no", "fp16", "bf16"), cells):
            for p in (False, True) if "full or PEFT" in label else (label.endswith("PEFT"),):
                assert (MATRIX[(weights, mp, p)] is None) == (cell == "ok")


def test_check_precision_rejects_bad_arguments():
    with pytest.raises(ValueError, match="weights_dtype must be"):
        check_precision(torch.int8, "no", True)
    with pytest.raises(ValueError, match="weights_dtype must be"):
        check_precision("bf16", "no", True)
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        check_precision(torch.float32, "fp8", False)
    with pytest.raises(TypeError, match="peft must be True"):
        check_precision(torch.float32, "no", "yes")
