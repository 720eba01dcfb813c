"""foak's axolotl plugin (foak.integrations.axolotl) through axolotl's own machinery: its PluginManager, its
config loading and validation (axolotl.cli.config.load_cfg: prepare_plugins, validate_config with the
plugin's input args merged in, normalize_config), its model loader (the plugin hooks) and its trainer builder
(axolotl.train.train), on a tiny Llama saved to a temporary directory (no downloads).

Needs axolotl: the axolotl test tier (requirements-axolotl.txt, a venv of its own; .ci/run builds it). Skipped
where axolotl is not installed (the main test environment).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

if importlib.util.find_spec("axolotl") is None:
    pytest.skip("axolotl is not installed: the axolotl tier's venv (requirements-axolotl.txt, docs/axolotl.md) runs "
                "this file", allow_module_level=True)
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")  # no telemetry (this machine has no network)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import yaml  # noqa: E402

import foak  # noqa: E402

PLUGIN = "foak.integrations.axolotl.FoakPlugin"
LIGER = "axolotl.integrations.liger.LigerPlugin"
CCE = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"


@pytest.fixture(scope="module", autouse=True)
def foak_installed(tmp_path_factory):
    """foak's distribution metadata on sys.path, as `pip install foak` (or `pip install -e`) writes it: its
    entry points from pyproject.toml's [project.entry-points] tables, among them axolotl's `axolotl.plugins`
    group, which axolotl 0.21 loads in every run (axolotl.integrations.base.get_builtin_plugins). This tier runs
    foak from PYTHONPATH=src, where axolotl would not see them; tests/test_packaging.py checks the built wheel's."""
    import sys
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    root = tmp_path_factory.mktemp("site")
    info = root / f"foak-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: foak\nVersion: {project['version']}\n")
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items()) + "\n"
        for group, points in groups.items()))
    sys.path.insert(0, str(root))
    yield
    sys.path.remove(str(root))


@pytest.fixture(autouse=True)
def fresh_plugin_manager():
    """axolotl's PluginManager is a process-wide singleton that keeps every plugin a config registered; each
    test starts from a new one (as each `axolotl train` process does)."""
    from axolotl.integrations import base

    def reset():
        base.PluginManager._instance = None
        base.PluginManager._cfg = None
        base.reset_plugin_entry_points_cache()

    reset()
    yield
    reset()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer Llama with a character tokenizer saved locally, and a jsonl corpus of short texts."""
    import transformers

    from foak.data import char_tokenizer

    root = tmp_path_factory.mktemp("axolotl")
    tok = char_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    with open(root / "data.jsonl", "w") as f:
        for i in range(48):
            f.write(json.dumps({"text": f"the cat sat on the mat, line {i}. " * (1 + i % 3)}) + "\n")
    return root


def axolotl_config(root, tmp_path, plugins=(PLUGIN,), **options):
    """An SFT config for the tiny Llama: fp32, sdpa, 2 steps of 2 rows of at most 128 tokens."""
    cfg = dict(
        base_model=str(root / "model"), datasets=[dict(path=str(root / "data.jsonl"), type="completion",
                                                       ds_type="json")],
        sequence_len=128, micro_batch_size=2, gradient_accumulation_steps=1, max_steps=2, learning_rate=1e-3,
        optimizer="adamw_torch", lr_scheduler="constant", output_dir=str(tmp_path / "out"),
        dataset_prepared_path=str(tmp_path / "prepared"), val_set_size=0, save_strategy="no", logging_steps=1,
        bf16=False, fp16=False, tf32=False, attn_implementation="sdpa", seed=0, dataset_num_proc=1,
        save_first_step=False)
    if plugins:
        cfg["plugins"] = list(plugins)
    cfg.update(options)
    return cfg


LORA = dict(adapter="lora", lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_target_linear=True)
# the unpatched LoRA runs: plain PEFT (axolotl's own LoRA kernels, which it would switch on, need CUDA)
PLAIN_PEFT = dict(lora_mlp_kernel=False, lora_qkv_kernel=False, lora_o_kernel=False)


def load(cfg: dict, tmp_path):
    """axolotl's own config loading (what `axolotl train config.yml` runs first) on the YAML file."""
    from axolotl.cli.config import load_cfg

    path = tmp_path / f"config{len(list(tmp_path.glob('config*.yml')))}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return load_cfg(str(path))


def train(cfg):
    """axolotl's dataset loading and trainer (axolotl.train.train: model loader, plugin hooks, trainer
    builder, trainer.train()); returns the losses of the logged steps and foak's plugin (loaded through its
    entry point whether or not the config lists it)."""
    from axolotl.cli.args import TrainerCliArgs
    from axolotl.common.datasets import load_datasets
    from axolotl.integrations.base import PluginManager
    from axolotl.train import train as axolotl_train

    meta = load_datasets(cfg=cfg, cli_args=TrainerCliArgs())
    _, _, trainer = axolotl_train(cfg=cfg, dataset_meta=meta)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, PluginManager.get_instance().plugins.get(PLUGIN)


def refusal(cfg, tmp_path) -> str:
    with pytest.raises(Exception) as info:
        load(cfg, tmp_path)
    return str(info.value)


@pytest.fixture
def reference_backend():
    foak.set_backend("reference")  # the kernels have their own interpreter tests; this is the wiring
    yield
    foak.set_backend(None)


# ---- config loading and validation -------------------------------------------------------------------------

def test_lora_config_turns_axolotl_lora_kernels_off(tiny_llama, tmp_path):
    """axolotl switches its own fused LoRA kernels on for LoRA when they are unset; with foak's plugin they
    are set false before validation (foak's fused_lora serves those layers). The foak key stays as given."""
    without = load(axolotl_config(tiny_llama, tmp_path, plugins=(), **LORA), tmp_path)
    assert (without.lora_mlp_kernel, without.lora_qkv_kernel, without.lora_o_kernel) == (True, True, True)
    cfg = load(axolotl_config(tiny_llama, tmp_path, **LORA, foak={"fused_linear_loss": False}), tmp_path)
    assert (cfg.lora_mlp_kernel, cfg.lora_qkv_kernel, cfg.lora_o_kernel) == (False, False, False)
    assert cfg.foak == {"fused_linear_loss": False}


@pytest.mark.parametrize("foak_key, kernels", [
    # axolotl's q/k/v and o kernels rewrite the attention forward with the modeling module's original RoPE function:
    # they stay off while foak's RoPE is on, the MLP kernel while foak's fast_swiglu is on
    ({"fused_lora": False}, (False, False, False, None)),
    ({"fused_lora": False, "fast_swiglu": False}, (True, False, False, True)),
    ({"fused_lora": False, "fast_swiglu": False, "fast_rope_embeddings": False}, (True, True, True, True)),
])
def test_with_foaks_fused_lora_off_axolotl_keeps_its_own_lora_kernels(tiny_llama, tmp_path, foak_key, kernels):
    """`foak: {fused_lora: false}`: axolotl's LoRA kernels serve the layers foak leaves to PEFT where no foak kernel
    that is on collides with them, as axolotl alone would switch them on (with lora_embedding_kernel). Before the
    fix the plugin set all three false whatever `foak:` said, and logged that foak served them."""
    cfg = load(axolotl_config(tiny_llama, tmp_path, **LORA, foak=foak_key), tmp_path)
    assert (cfg.lora_mlp_kernel, cfg.lora_qkv_kernel, cfg.lora_o_kernel, cfg.lora_embedding_kernel) == kernels


@pytest.mark.parametrize("foak_key, adapter, expected", [
    ({"fast_rms_norm": True}, None, "unknown key 'fast_rms_norm' in foak; did you mean 'fast_rms_layernorm'?"),
    ({"fast_swiglu": "yes"}, None, "foak.fast_swiglu: expected a boolean (true or false), got str 'yes'"),
    ({"fused_lora": True}, None, "foak.fused_lora: True needs `adapter: lora` or `adapter: qlora`"),
    ({"fast_loss": True, "fused_linear_loss": True}, "lora", "fast_loss and fused_linear_loss are both true in foak"),
    ({"mode": "peft"}, "lora", "foak.mode: not a setting here; foak's mode follows axolotl's `adapter`"),
    (["fast_swiglu"], None, "foak: must be a mapping of foak switches"),
])
def test_foak_key_is_checked_by_foaks_schema(tiny_llama, tmp_path, foak_key, adapter, expected):
    options = dict(LORA) if adapter else {}
    message = refusal(axolotl_config(tiny_llama, tmp_path, foak=foak_key, **options), tmp_path)
    assert expected in message


@pytest.mark.parametrize("plugins, options, expected", [
    ((LIGER, PLUGIN), {"liger_rms_norm": True},
     "liger_rms_norm: True and foak's fast_rms_layernorm both replace the RMSNorm; remove liger_rms_norm"),
    ((PLUGIN, LIGER), {"liger_fused_linear_cross_entropy": True},
     "liger_fused_linear_cross_entropy: True and foak's fused_linear_loss / fast_loss both replace the LM head"),
    ((PLUGIN, CCE), {}, "cut_cross_entropy: True and foak's fused_linear_loss / fast_loss both replace"),
    ((PLUGIN,), dict(LORA, lora_qkv_kernel=True),
     ("lora_qkv_kernel: True and foak's fused_lora / fast_rope_embeddings both replace the LoRA q/k/v projections "
      "(axolotl's rewritten attention forward calls its own copy of apply_rotary_pos_emb: foak's RoPE would not run)")),
    ((PLUGIN,), dict(LORA, lora_o_kernel=True, foak={"fused_lora": False}),  # (before the fix: foak's RoPE silently
     "lora_o_kernel: True and foak's fast_rope_embeddings both replace"),        # never ran, its row claimed 2 modules)
    ((PLUGIN,), dict(LORA, lora_mlp_kernel=True), "lora_mlp_kernel: True and foak's fused_lora / fast_swiglu"),
    ((LIGER, PLUGIN), {"liger_rms_norm_gated": True},
     "liger_rms_norm_gated: True and foak's fast_rms_layernorm both replace the gated RMSNorm"),
    ((PLUGIN,), {"fused_attn_kernel": True},
     "fused_attn_kernel: True and foak's fast_rms_layernorm / fast_rope_embeddings both replace the q/k norms and"),
    ((PLUGIN,), {"tiled_mlp": True}, "axolotl's tiled_mlp and foak's fast_swiglu both replace the MLP's forward"),
    ((PLUGIN,), {"chunked_cross_entropy": True}, "chunked_cross_entropy: True and foak's fused_linear_loss"),
    ((PLUGIN,), {"rl": "dpo"}, "rl: dpo: foak's axolotl plugin serves supervised fine-tuning"),
    ((PLUGIN,), {"activation_offloading": True, "gradient_checkpointing": True, "foak": {"offload_activations": True}},
     "axolotl's activation offloading and foak's offload_activations both move the checkpointed activations"),
    ((PLUGIN,), {"context_parallel_size": 2}, "context_parallel_size: 2: foak is not tested with tensor, context"),
    ((PLUGIN,), {"fp8": True}, "fp8: true: foak's kernels are not tested on fp8"),
    ((PLUGIN,), dict(LORA, adapter="qlora", load_in_4bit=True, fsdp_version=2,
                     fsdp_config={"reshard_after_forward": True}),
     "adapter: qlora with FSDP2: axolotl stores the 4-bit weights as bf16"),
])
def test_overlapping_or_untested_axolotl_options_are_refused(tiny_llama, tmp_path, plugins, options, expected):
    message = refusal(axolotl_config(tiny_llama, tmp_path, plugins=plugins, **options), tmp_path)
    assert "foak: " + expected in message
    assert message.count("Value error") == 1 and " more: " not in message  # one refusal, one line


@pytest.mark.parametrize("plugins, options, foak_key", [
    ((LIGER, PLUGIN), {"liger_rms_norm": True, "liger_layer_norm": True}, {"fast_rms_layernorm": False}),
    ((PLUGIN, CCE), {}, {"fused_linear_loss": False, "fast_loss": False}),
    ((PLUGIN,), dict(LORA, lora_qkv_kernel=True, lora_o_kernel=True),
     {"fused_lora": False, "fast_rope_embeddings": False}),
    ((PLUGIN,), dict(LORA, adapter="qlora", load_in_4bit=True, fsdp_version=2,
                     fsdp_config={"reshard_after_forward": True}), {"fused_lora": False}),
    ((PLUGIN,), {"fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True}}, None),
])
def test_the_refused_combinations_load_once_foaks_kernel_is_off(tiny_llama, tmp_path, plugins, options, foak_key):
    cfg = load(axolotl_config(tiny_llama, tmp_path, plugins=plugins, foak=foak_key, **options), tmp_path)
    assert cfg.foak == foak_key
    assert PLUGIN in cfg.plugins


def test_foak_key_overrides_foaks_defaults(tiny_llama):
    """resolve_config: foak.patch's defaults for the model, each given switch overriding its default; setting
    fast_loss true drops fused_linear_loss (they exclude each other)."""
    import transformers

    from foak.integrations.axolotl import resolve_config
    from foak.api import default_config

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama / "model")
    defaults = default_config(model)
    assert defaults.fused_linear_loss and defaults.fast_rope_embeddings and not defaults.tiled_mlp
    assert resolve_config(model, None) == defaults
    cfg = resolve_config(model, {"fast_rope_embeddings": False, "fast_loss": True, "tiled_mlp": True})
    assert (cfg.fast_rope_embeddings, cfg.fast_loss, cfg.fused_linear_loss, cfg.tiled_mlp) == (False, True, False, True)
    assert cfg.fast_rms_layernorm and cfg.fast_swiglu and cfg.fast_packed_attention and cfg.mode == "full"


def test_a_config_without_the_plugin_is_left_alone(tiny_llama, tmp_path):
    """The PluginManager keeps foak registered for the rest of the process (and loads it through its entry point
    wherever foak is installed); a config that does not name it and has no `foak:` key is not checked (Liger and
    axolotl's LoRA kernels as usual) and its model is not patched."""
    from axolotl.integrations.base import PluginManager

    load(axolotl_config(tiny_llama, tmp_path, **LORA), tmp_path)
    cfg = load(axolotl_config(tiny_llama, tmp_path, plugins=(LIGER,), liger_rms_norm=True, **LORA), tmp_path)
    assert cfg.lora_qkv_kernel is True and cfg.liger_rms_norm is True and "foak" not in cfg
    plain = load(axolotl_config(tiny_llama, tmp_path, plugins=(), **LORA), tmp_path)
    assert PLUGIN in PluginManager.get_instance().plugins  # (the entry point) and the config is axolotl's alone:
    assert plain.lora_qkv_kernel is True and "foak" not in plain and not plain.plugins


@pytest.mark.parametrize("plugins, foak_key, add", [
    ((), {"fused_linear_loss": False}, f"plugins: [{PLUGIN}]"),
    ((), None, f"plugins: [{PLUGIN}]"),  # (`foak:` left empty: foak's defaults, had the plugin been listed)
    ((LIGER,), {"fast_rope_embeddings": False}, f"plugins: [{LIGER}, {PLUGIN}]"),
])
def test_a_foak_key_without_the_plugin_is_refused(tiny_llama, tmp_path, plugins, foak_key, add):
    """A `foak:` key in a config whose `plugins:` does not list foak's plugin: axolotl alone drops the unknown key
    (its schema ignores extra keys) and trains without foak, saying nothing. foak's entry point in axolotl's
    `axolotl.plugins` group loads the plugin in every run; its schema refuses that config with one line that
    says what to add. Before: the config loaded, without the key, and the model was never patched."""
    message = refusal(axolotl_config(tiny_llama, tmp_path, plugins=plugins, foak=foak_key), tmp_path)
    assert (f"foak: this config has a `foak:` key but does not list foak's plugin under `plugins:`, so foak would "
            f"not run: add `{add}` (or remove the `foak:` key)") in message, message
    assert message.count("Value error") == 1
    listed = load(axolotl_config(tiny_llama, tmp_path, plugins=(*plugins, PLUGIN), foak=foak_key), tmp_path)
    assert listed.foak == foak_key and PLUGIN in listed.plugins  # with the plugin listed: loads as before


def test_pre_model_load_refuses_an_architecture_foak_does_not_serve(tiny_llama, tmp_path):
    import transformers
    from axolotl.integrations.base import PluginManager

    from foak.models import ARCHITECTURES

    assert "gpt2" not in ARCHITECTURES
    model_dir = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=48, n_embd=32, n_layer=1, n_head=2)) \
        .save_pretrained(model_dir)
    cfg = load(axolotl_config(tiny_llama, tmp_path, base_model=str(model_dir),
                              tokenizer_config=str(tiny_llama / "model")), tmp_path)
    with pytest.raises(ValueError, match="foak has no rules for model_type 'gpt2'"):
        PluginManager.get_instance().pre_model_load(cfg)


def test_pre_model_load_refuses_fp16_full_fine_tuning(tiny_llama, tmp_path):
    from axolotl.integrations.base import PluginManager

    cfg = load(axolotl_config(tiny_llama, tmp_path, fp16=True), tmp_path)
    assert cfg.torch_dtype == torch.float16
    with pytest.raises(ValueError, match="foak: fp16 weights with full fine-tuning"):
        PluginManager.get_instance().pre_model_load(cfg)


# ---- training through axolotl's trainer builder --------------------------------------------------------------

def assert_same_losses(patched, unpatched):
    assert len(patched) == len(unpatched) == 2
    for a, b in zip(patched, unpatched):
        assert abs(a - b) <= 1e-5 * abs(b), (patched, unpatched)


def rows(report):
    return {r.rule_id: r for r in report.results}


def test_full_fine_tuning_two_steps_match_axolotl_without_foak(tiny_llama, tmp_path, reference_backend):
    unpatched, unlisted = train(load(axolotl_config(tiny_llama, tmp_path / "a", plugins=()), tmp_path))
    assert unlisted.report is None  # loaded through foak's entry point, not listed: it patched nothing
    patched, plugin = train(load(axolotl_config(tiny_llama, tmp_path / "b"), tmp_path))
    assert_same_losses(patched, unpatched)
    table = rows(plugin.report)
    for rule, modules in [("llama.rms_norm", 5), ("llama.rope", 2), ("llama.swiglu", 2),
                          ("llama.fused_linear_loss", 1)]:
        assert table[rule].modules == modules, plugin.report
    assert "llama.fused_lora" not in table  # full fine-tuning: foak.patch's defaults have no fused_lora


def test_lora_with_sample_packing_two_steps_match_axolotl_without_foak(tiny_llama, tmp_path, reference_backend):
    """LoRA + axolotl's multipack: axolotl drops the attention mask and restarts the position ids per
    sequence; foak's packed attention runs every attention call of the packed batches per sequence."""
    options = dict(LORA, sample_packing=True, pad_to_sequence_len=True)
    unpatched, _ = train(load(axolotl_config(tiny_llama, tmp_path / "a", plugins=(), **options, **PLAIN_PEFT),
                              tmp_path))
    patched, plugin = train(load(axolotl_config(tiny_llama, tmp_path / "b", **options), tmp_path))
    assert_same_losses(patched, unpatched)
    table = rows(plugin.report)
    assert table["llama.fused_lora"].modules == 14  # q, k, v, o, gate, up, down in 2 layers
    assert table["llama.packed_attention"].modules == 1
    note = table["llama.packed_attention"].notes
    assert "foak varlen attention ran 4 calls" in note, note  # 2 layers x 2 steps, all packed
    assert "not a packed batch" not in note, note


def test_qlora_two_steps_match_axolotl_without_foak(tiny_llama, tmp_path, reference_backend):
    """QLoRA: axolotl's bitsandbytes NF4 base (its 4-bit weights stored as bf16), LoRA on every linear, with
    axolotl's gradient checkpointing; foak's fused_lora dequantizes the NF4 base itself."""
    options = dict(LORA, adapter="qlora", load_in_4bit=True, gradient_checkpointing=True)
    unpatched, _ = train(load(axolotl_config(tiny_llama, tmp_path / "a", plugins=(), **options, **PLAIN_PEFT),
                              tmp_path))
    patched, plugin = train(load(axolotl_config(tiny_llama, tmp_path / "b", **options), tmp_path))
    assert_same_losses(patched, unpatched)
    row = rows(plugin.report)["llama.fused_lora"]
    assert row.modules == 14 and "14 bitsandbytes NF4 Linear4bit" in row.notes, plugin.report
