"""foak as an fms-acceleration plugin (foak/integrations/fms_acceleration.py), driven through fms_acceleration's
own API as fms-hf-tuning drives it: ``AccelerationFramework(yaml)`` -> ``augmentation(model, train_args,
modifiable_args)`` -> (the trainer adds LoRA) -> ``get_callbacks_and_ready_for_train(model, accelerator)``.

Needs fms-acceleration 0.6.4, installed without its dependencies (it pins numpy<2; at run time it needs torch,
transformers, accelerate, peft, pyyaml and pandas, all here): ``pip install --no-deps fms-acceleration==0.6.4``.
Tiny fp32 Llama on foak's torch reference ops (the kernels have their own tests); the patched model's loss and
gradients are compared with an unpatched copy to 1e-5.
"""

from __future__ import annotations

import copy
import json
import sys
from types import SimpleNamespace

import pytest
import torch
import transformers
import yaml
from fms_acceleration import AccelerationFramework, AccelerationPluginConfigError
from fms_acceleration.framework_plugin import PLUGIN_REGISTRATIONS, AccelerationPlugin
from test_patching import assert_close, assert_grads_close, build, loss_and_grads, padded_batch

import foak
import foak.integrations.fms_acceleration as plugin_module
from foak.config import FULL_STANZA, PEFT_STANZA
from foak.patching import peft as peft_rules
from foak.patching import replacements

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_PATCHED: list = []


@pytest.fixture(autouse=True)
def _fresh_framework(reference_ops):
    """AccelerationFramework keeps its active plugins in class attributes (a second framework in one process
    would reuse the first one's plugin objects): each test starts from none and leaves them as they were."""
    saved = AccelerationFramework.active_plugins, AccelerationFramework.plugins_require_custom_loading
    AccelerationFramework.active_plugins, AccelerationFramework.plugins_require_custom_loading = [], []
    yield
    AccelerationFramework.active_plugins, AccelerationFramework.plugins_require_custom_loading = saved
    while _PATCHED:
        foak.restore(_PATCHED.pop())


def framework(tmp_path, plugins: dict) -> AccelerationFramework:
    path = tmp_path / "acceleration.yaml"
    path.write_text(yaml.safe_dump({"plugins": plugins}))
    return AccelerationFramework(str(path))


def stanza(path: str, switches: dict) -> dict:
    tree = switches
    for key in reversed(path.split(".")):
        tree = {key: tree}
    return tree


def foak_plugin(fw: AccelerationFramework) -> plugin_module.FoakAccelerationPlugin:
    (name, plugin), = fw.active_plugins
    assert name == "FoakAccelerationPlugin"
    return plugin


def train_args(tmp_path, **kwargs):
    return transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], **kwargs)


@pytest.fixture
def op_calls(monkeypatch):
    """Calls of the foak ops that the replacement forwards look up at call time."""
    calls: dict[str, int] = {}
    targets = [(replacements, n) for n in ("rms_norm", "rope", "cross_entropy", "linear_cross_entropy")]
    targets += [(peft_rules, n) for n in ("lora_linear", "lora_linears", "lora_glu_linear")]
    for module, name in targets:
        calls[name] = 0

        def counted(*args, _fn=getattr(module, name), _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


# ---- full fine-tuning and LoRA through the framework ------------------------------------------------------

@pytest.mark.parametrize("loss", [True, "fused_ce_liger"])
def test_full_finetuning_is_patched_and_exact(tmp_path, op_calls, loss):
    import accelerate

    # fms-acceleration-foak's fast-kernels config (fast_loss: fused_ce_liger: its fused linear cross-entropy)
    fw = framework(tmp_path, stanza(FULL_STANZA, {"fast_loss": loss, "fast_rms_layernorm": True,
                                                  "fast_rope_embeddings": True}))
    plugin = foak_plugin(fw)
    assert fw.requires_augmentation and not fw.requires_custom_loading
    model = build("llama")
    reference = copy.deepcopy(model)
    returned, modifiable = fw.augmentation(model, train_args(tmp_path), modifiable_args=(None,))
    assert returned is model and modifiable == (None,) and not foak.patching.is_patched(model)
    assert plugin.mixed_precision == "no"

    had_state = accelerate.state.AcceleratorState._shared_state != {}
    try:
        assert fw.get_callbacks_and_ready_for_train(model, accelerate.Accelerator(cpu=True)) == []
    finally:
        if not had_state:
            accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    _PATCHED.append(model)
    loss_rule = "loss" if loss is True else "fused_linear_loss"
    report = plugin.report
    assert {r.rule_id: r.modules for r in report.results} == {
        "llama.rms_norm": 5, "llama.rms_norm_recompute": 1, "llama.rope": 2, f"llama.{loss_rule}": 1}
    assert bool(plugin.translations) == (loss != True)  # noqa: E712  (the seed's value was translated)

    batch = padded_batch()
    ref_out, ref_grads = loss_and_grads(reference, batch)
    assert not any(op_calls.values())
    out, grads = loss_and_grads(model, batch)
    assert op_calls["rms_norm"] == 5 and op_calls["rope"] == 2
    assert (op_calls["cross_entropy"], op_calls["linear_cross_entropy"]) == ((1, 0) if loss is True else (0, 1))
    assert_close(out.loss, ref_out.loss, "loss")
    assert_grads_close(grads, ref_grads, "full fine-tuning through fms-acceleration")


def test_lora_is_patched_and_exact(tmp_path, op_calls):
    import peft

    fw = framework(tmp_path, stanza(PEFT_STANZA, {"fused_lora": True, "fast_loss": True, "fast_rms_layernorm": True,
                                                  "fast_rope_embeddings": True}))
    plugin = foak_plugin(fw)
    model = build("llama")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PROJECTIONS, init_lora_weights=False,
                           task_type="CAUSAL_LM")
    returned, (peft_config,) = fw.augmentation(model, train_args(tmp_path), modifiable_args=(lora,))
    assert returned is model and peft_config is lora
    # what SFTTrainer(peft_config=...) does next; fms-hf-tuning then hands the framework the model it loaded
    peft_model = peft.get_peft_model(model, peft_config)
    reference = copy.deepcopy(peft_model)
    assert fw.get_callbacks_and_ready_for_train(model, None) == []
    _PATCHED.append(model)
    assert {r.rule_id: r.modules for r in plugin.report.results} == {
        "llama.rms_norm": 5, "llama.rms_norm_recompute": 1, "llama.fused_lora_qkv": 2, "llama.rope": 2,
        "llama.loss": 1, "llama.fused_lora": 14}

    batch = padded_batch()
    ref_out, ref_grads = loss_and_grads(reference, batch)
    assert not any(op_calls.values())
    out, grads = loss_and_grads(peft_model, batch)
    # all 14 LoRA layers fused: q/k/v of each layer as one lora_linears call, o/gate/up/down one lora_linear each
    # (the gated-MLP block is fast_swiglu's, which the seed's keys do not name)
    assert (op_calls["lora_linears"], op_calls["lora_linear"], op_calls["lora_glu_linear"]) == (2, 8, 0), op_calls
    assert op_calls["rms_norm"] == 5 and op_calls["rope"] == 2 and op_calls["cross_entropy"] == 1
    assert_close(out.loss, ref_out.loss, "loss")
    assert sum(g is not None for g in grads.values()) == 28  # every LoRA A and B
    assert_grads_close(grads, ref_grads, "LoRA through fms-acceleration")


def test_lora_added_after_ready_for_train_is_fused_and_the_peft_model_deepcopies(tmp_path, op_calls):
    """The other order: get_callbacks_and_ready_for_train before the trainer wraps the model in PEFT (a script that
    builds its trainer last). The LoRA layers are fused from the first forward; a deepcopy of the PeftModel (an
    EMA or reference copy) is a PeftModel with its own patched model: before the fix it was a copy of the causal
    LM inside it (the patched model's __deepcopy__, reached through PEFT's attribute forwarding)."""
    import peft

    fw = framework(tmp_path, stanza(PEFT_STANZA, {"fused_lora": True, "fast_rms_layernorm": True}))
    model = build("llama")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PROJECTIONS, init_lora_weights=False,
                           task_type="CAUSAL_LM")
    fw.augmentation(model, train_args(tmp_path), modifiable_args=(lora,))
    fw.get_callbacks_and_ready_for_train(model, None)
    _PATCHED.append(model)
    twin = build("llama")
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(model, lora)
    torch.manual_seed(1)
    reference = peft.get_peft_model(twin, lora)
    batch = padded_batch()
    out, grads = loss_and_grads(peft_model, batch)
    assert (op_calls["lora_linears"], op_calls["lora_linear"], op_calls["rms_norm"]) == (2, 8, 5), op_calls
    ref_out, ref_grads = loss_and_grads(reference, batch)
    assert_close(out.loss, ref_out.loss, "loss")
    assert_grads_close(grads, ref_grads, "LoRA added after ready_for_train")
    assert foak_plugin(fw).report.result("llama.fused_lora").modules == 14

    clone = copy.deepcopy(peft_model)
    assert isinstance(clone, peft.PeftModel) and clone.get_base_model() is not model
    _PATCHED.append(clone.get_base_model())
    assert foak.patching.is_patched(clone.get_base_model())
    calls_before = dict(op_calls)
    clone_out, _ = loss_and_grads(clone, batch)
    assert op_calls["lora_linear"] == calls_before["lora_linear"] + 8
    assert_close(clone_out.loss, ref_out.loss, "loss of the copy")


def test_config_file_from_the_environment(tmp_path, monkeypatch):
    # AccelerationFramework reads ACCELERATION_FRAMEWORK_CONFIG_FILE when it gets no file or one with an empty
    # 'plugins:' (what fms-hf-tuning writes when none of its acceleration flags is given)
    config = tmp_path / "foak.yaml"
    config.write_text(yaml.safe_dump({"plugins": stanza(FULL_STANZA, {"fast_rms_layernorm": True})}))
    monkeypatch.setenv("ACCELERATION_FRAMEWORK_CONFIG_FILE", str(config))
    empty = tmp_path / "empty.yaml"
    empty.write_text(yaml.safe_dump({"plugins": {}}))
    assert foak_plugin(AccelerationFramework(str(empty))).config.fast_rms_layernorm
    AccelerationFramework.active_plugins = []
    assert foak_plugin(AccelerationFramework()).config.fast_rms_layernorm


def test_qlora_nf4_with_the_seeds_sample_stanza(tmp_path):
    from test_lora_nf4_rules import qlora_llama
    from test_lora_rules import assert_same_training, calls

    from foak.models.tiny import tiny_model
    from foak.testing import bitsandbytes_dequant_by_formula

    torch.manual_seed(0)
    tiny_model("llama").save_pretrained(tmp_path / "tiny")
    # fms-acceleration's accelerated-peft-bnb-nf4-foak sample stanza, spelling included
    fw = framework(tmp_path, stanza(PEFT_STANZA, {"base_layer": "bitsandbytes", "fused_lora": True, "fast_loss": True,
                                                  "fast_rsm_layernorm": True, "fast_rope_embeddings": True}))
    with bitsandbytes_dequant_by_formula():  # (the comparison is with NF4 math; see test_lora_nf4_rules)
        model = qlora_llama(tmp_path / "tiny", torch.float32, torch.float32)  # as fms-acceleration-peft hands it
        reference = copy.deepcopy(model)
        fw.augmentation(model, train_args(tmp_path), modifiable_args=(None,))
        fw.get_callbacks_and_ready_for_train(model, None)
        _PATCHED.append(model)
        report = foak_plugin(fw).report
        row = report.result("llama.fused_lora")
        assert row.modules == 14 and "bases: 14 bitsandbytes NF4 Linear4bit" in row.notes, str(report)
        assert report.count("llama.rms_norm") == 5 and report.count("llama.loss") == 1
        assert assert_same_training(model, reference) == 28
        assert calls(report) == (14, {}), row.notes


# ---- the stanza: the seed's configs, translations, errors -------------------------------------------------

def test_the_seeds_sample_configs_are_read(tmp_path):
    # fms-acceleration's accelerated-peft-bnb-nf4-foak sample (the other plugin's bitsandbytes stanza beside
    # ours is not handed to foak's plugin), with its fast_rsm_layernorm spelling
    fw = framework(tmp_path, {"peft": {"quantization": {
        "bitsandbytes": {"quant_type": "nf4", "no_peft_model": False},
        "fused_ops_and_kernels": {"base_layer": "bitsandbytes", "fused_lora": True, "fast_loss": True,
                                  "fast_rsm_layernorm": True, "fast_rope_embeddings": True}}}})
    plugin = foak_plugin(fw)
    config = plugin.config
    assert (config.mode, config.base_layer, config.fused_lora, config.fast_loss, config.fast_rms_layernorm,
            config.fast_rope_embeddings, config.fused_linear_loss) == ("peft", "bitsandbytes", True, True, True, True,
                                                                       False)
    assert plugin.translations == [
        f"{PEFT_STANZA}.fast_rsm_layernorm read as fast_rms_layernorm: True (the spelling of fms-acceleration's "
        "sample configs and fms-hf-tuning's FastKernelsConfig)"]


def test_fms_hf_tuning_dataclass_dump_and_auto_gptq(tmp_path):
    # fms-hf-tuning's FusedLoraConfig + FastKernelsConfig as it dumps them (base_layer: null when not given)
    fw = framework(tmp_path, stanza(PEFT_STANZA, {"base_layer": None, "fused_lora": False, "fast_loss": True,
                                                  "fast_rsm_layernorm": True, "fast_rope_embeddings": True}))
    config = foak_plugin(fw).config
    assert (config.base_layer, config.fused_lora, config.fast_rms_layernorm) == ("none", False, True)
    config, notes = plugin_module.config_from_plugin_configurations(
        stanza(PEFT_STANZA, {"base_layer": "auto_gptq", "fused_lora": True}))
    assert config.base_layer == "gptq" and notes == [f"{PEFT_STANZA}.base_layer: auto_gptq read as base_layer: gptq "
                                                     "(foak fuses LoRA over its own GPTQLinear layers)"]


@pytest.mark.parametrize("path,switches,message", [
    (FULL_STANZA, {"fast_rms_norm": True}, "unknown key 'fast_rms_norm' in training.fused_ops_and_kernels; did you "
                                           "mean 'fast_rms_layernorm'?"),
    (FULL_STANZA, {"fast_loss": "liger"}, "training.fused_ops_and_kernels.fast_loss: expected true, false or "
                                          "'fused_ce_liger'"),
    (FULL_STANZA, {"fast_loss": "fused_ce_liger", "fused_linear_loss": False}, "remove one of the two"),
    (FULL_STANZA, {"fast_loss": True, "fused_linear_loss": True}, "fast_loss and fused_linear_loss are both true"),
    (FULL_STANZA, {"fast_rsm_layernorm": True, "fast_rms_layernorm": False}, "disagree"),
    (FULL_STANZA, {"fast_rope_embeddings": "yes"}, "fast_rope_embeddings: expected a boolean"),
    (FULL_STANZA, {"fused_lora": True}, "full fine-tuning has no LoRA adapters"),
    (PEFT_STANZA, {"fused_lora": True, "base_layer": "awq"}, "base_layer: expected auto_gptq or bitsandbytes"),
    (None, None, "exactly one must be used"),
    (PEFT_STANZA, {"base_layer": None, "fused_lora": False, "fast_loss": False}, "switches no kernel on"),
])
def test_keys_foak_cannot_honour_are_one_clear_line(tmp_path, path, switches, message):
    plugins = (stanza(path, switches) if path else
               {**stanza(FULL_STANZA, {"fast_loss": True}), **stanza(PEFT_STANZA, {"fused_lora": True})})
    with pytest.raises(ValueError, match=None) as info:
        framework(tmp_path, plugins)
    assert isinstance(info.value, AccelerationPluginConfigError)
    text = str(info.value)
    assert message in text and "\n" not in text, text


def test_model_checks_before_the_trainer_and_at_patch_time(tmp_path):
    import peft

    fw = framework(tmp_path, stanza(FULL_STANZA, {"fast_rms_layernorm": True}))
    model = build("llama").to(torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 weights with mixed_precision='fp16'"):
        fw.augmentation(model, SimpleNamespace(bf16=False, fp16=True), modifiable_args=(None,))
    with pytest.raises(ValueError, match="foak has no rules for model_type 'gpt2'"):
        fw.augmentation(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)),
                        None, modifiable_args=(None,))

    AccelerationFramework.active_plugins = []
    fw = framework(tmp_path, stanza(PEFT_STANZA, {"base_layer": "auto_gptq", "fused_lora": True}))
    lora_model = peft.get_peft_model(build("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="foak fuses LoRA over its own GPTQLinear .* not over auto_gptq/gptqmodel's"):
        fw.get_callbacks_and_ready_for_train(lora_model, None)
    assert not foak.patching.is_patched(lora_model)


# ---- registration --------------------------------------------------------------------------------------

def test_registered_once_for_both_stanzas():
    ours = [r for r in PLUGIN_REGISTRATIONS if r.plugin is plugin_module.FoakAccelerationPlugin]
    assert len(ours) == 1 and ours[0].OR == [FULL_STANZA, PEFT_STANZA] and ours[0].package_name == "foak"
    before = len(PLUGIN_REGISTRATIONS)
    plugin_module.register()
    assert len(PLUGIN_REGISTRATIONS) == before


def test_another_plugin_on_the_same_stanza_is_refused(tmp_path):
    ours = []
    # (a module inside a package: register_plugin looks its package's version up)
    seed = type("FastKernelsAccelerationPlugin", (AccelerationPlugin,), {"__module__": "fms_acceleration.framework"})
    AccelerationPlugin.register_plugin(seed, configuration_or_paths=[PEFT_STANZA])
    try:
        with pytest.raises(ValueError, match="FastKernelsAccelerationPlugin .* read the same stanzas, so both would "
                                             "patch the model.*pip uninstall fms-acceleration-foak"):
            framework(tmp_path, stanza(PEFT_STANZA, {"fast_loss": True}))
        # importing foak's plugin module when the other one is already registered (as fms_acceleration does with
        # an installed fms_acceleration_foak) refuses to register
        ours = [r for r in PLUGIN_REGISTRATIONS if r.plugin is plugin_module.FoakAccelerationPlugin]
        PLUGIN_REGISTRATIONS[:] = [r for r in PLUGIN_REGISTRATIONS if r not in ours]
        with pytest.raises(ValueError, match="FastKernelsAccelerationPlugin of fms_acceleration"):
            plugin_module.register()
        assert not any(r.plugin is plugin_module.FoakAccelerationPlugin for r in PLUGIN_REGISTRATIONS)
    finally:
        PLUGIN_REGISTRATIONS[:] = [r for r in PLUGIN_REGISTRATIONS if r.plugin is not seed]
        if not any(r.plugin is plugin_module.FoakAccelerationPlugin for r in PLUGIN_REGISTRATIONS):
            PLUGIN_REGISTRATIONS.extend(ours)


def test_launcher_runs_a_module_with_the_plugin_registered(tmp_path, monkeypatch, capsys):
    (tmp_path / "fake_sft_trainer.py").write_text(
        "import json, sys\n"
        "from fms_acceleration.framework_plugin import PLUGIN_REGISTRATIONS\n"
        "if __name__ == '__main__':\n"
        "    json.dump({'argv': sys.argv[1:], 'plugins': [r.plugin.__name__ for r in PLUGIN_REGISTRATIONS]},\n"
        "              open(sys.argv[-1], 'w'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    out = tmp_path / "seen.json"
    plugin_module.main(["fake_sft_trainer", "--acceleration_framework_config_file", "foak.yaml", str(out)])
    seen = json.loads(out.read_text())
    assert seen == {"argv": ["--acceleration_framework_config_file", "foak.yaml", str(out)],
                    "plugins": ["FoakAccelerationPlugin"]}
    with pytest.raises(SystemExit) as exit_info:
        plugin_module.main([])
    assert exit_info.value.code == 2 and "usage: python -m foak.integrations.fms_acceleration MODULE" in \
        capsys.readouterr().err
