"""``foak train``: fine-tune a causal LM with HF Trainer, foak's kernels patched in by the acceleration
config. Arguments are HF ``TrainingArguments`` names plus :class:`FoakArguments`. With no model and no
dataset it trains the embedded default: a tiny Llama built from a config, a character tokenizer and a
generated corpus, all made locally.

Without ``--acceleration_config`` the kernels are chosen as follows (``--acceleration_config none``: no foak):

- ``--peft lora`` / ``--peft qlora-nf4``, any model (the embedded one or ``--model``): the
  ``peft.quantization.fused_ops_and_kernels`` stanza with ``fused_lora`` (foak's fused LoRA layers) and
  ``fast_rms_layernorm``, ``fast_rope_embeddings``, ``fast_swiglu``, ``fused_linear_loss`` (:data:`PEFT_KERNELS`);
- full fine-tuning (``--peft none``) of the embedded model: ``training.fused_ops_and_kernels`` with those four
  kernels (:data:`EMBEDDED_KERNELS`); of a ``--model`` or ``--dataset`` of yours: no kernels (the baseline).

A ``--model`` directory whose config.json has ``quantization_config.quant_method: gptq`` (e.g. one written by
:func:`foak.quant.save_gptq`) is loaded by :func:`foak.quant.load_gptq` (its 4-bit linears become foak's
``GPTQLinear``, computing in the --bf16/--fp16/fp32 dtype; transformers' own GPTQ path, which needs gptqmodel, is
not used) and trained with ``--peft lora`` only: PEFT wraps the GPTQ layers with foak's ``GPTQLoraLinear``
(:func:`foak.quant.gptq_peft.register_gptq_lora`) and the default config's fused_lora takes them.

The patch report is printed before training and again after it, when the ``fused_lora`` row holds the call
counts (fused calls, calls that took PEFT's own forward and why); the summary carries them too."""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from foak.data import (
    PackingCollator,
    PaddingCollator,
    char_tokenizer,
    generated_corpus,
    read_jsonl,
    tokenize,
)

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# TrainingArguments defaults foak sets unless the command line gives them
TRAINER_DEFAULTS = {"output_dir": "foak-output", "report_to": "none", "save_strategy": "no",
                    "logging_steps": "5", "per_device_train_batch_size": "8"}
# the kernels the default configs switch on (every kernel foak has for the tiny Llama)
KERNELS = {"fast_rms_layernorm": True, "fast_rope_embeddings": True, "fast_swiglu": True, "fused_linear_loss": True}
# full fine-tuning of the embedded default
EMBEDDED_KERNELS = {"training": {"fused_ops_and_kernels": dict(KERNELS)}}
# a LoRA / QLoRA run (--peft) of any model: foak's fused LoRA layers plus the same kernels
PEFT_KERNELS = {"peft": {"quantization": {"fused_ops_and_kernels": {"fused_lora": True, **KERNELS}}}}
EMBEDDED_DEFAULTS = {"max_steps": "60", "learning_rate": "3e-3", "warmup_steps": "5",
                     "per_device_train_batch_size": "16"}


@dataclass
class FoakArguments:
    model: str | None = field(default=None, metadata={
        "help": "local path of an HF causal LM, or of a GPTQ 4-bit checkpoint (with --peft lora) (default: tiny)"})
    dataset: str | None = field(default=None, metadata={"help": "JSONL file: {'text': ...} or {'prompt', 'response'}"})
    text_field: str = field(default="text", metadata={"help": "the JSONL field holding plain text"})
    max_seq_length: int = field(default=128, metadata={"help": "longer sequences are truncated (and counted)"})
    packing: bool = field(default=False, metadata={"help": "padding-free packing with restarting position_ids"})
    peft: str = field(default="none", metadata={
        "help": "none | lora | qlora-nf4. Without --acceleration_config a LoRA/QLoRA run of any model (yours "
                "too) uses foak's fused LoRA layers (fused_lora) plus the RMSNorm, RoPE, SwiGLU and fused "
                "linear+loss kernels"})
    lora_r: int = 16
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    acceleration_config: str | None = field(
        default=None,
        metadata={"help": "foak YAML (see README); 'none' trains without foak. Default: with --peft lora or "
                          "qlora-nf4, fused_lora and every kernel (the peft stanza) for any model; full "
                          "fine-tuning: every kernel for the embedded tiny model, none for a model of yours"},
    )


class TokenCounter:
    """Wraps a collator and counts the tokens it hands to the model (for tokens/s)."""

    def __init__(self, collator):
        self.collator, self.tokens = collator, 0

    def __call__(self, features):
        batch = self.collator(features)
        mask = batch.get("attention_mask")
        self.tokens += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        return batch


def parse_arguments(argv: list[str]):
    from transformers import HfArgumentParser, TrainingArguments

    given = {a.split("=")[0].lstrip("-") for a in argv if a.startswith("--")}
    defaults = dict(TRAINER_DEFAULTS)
    if "model" not in given and "dataset" not in given:
        defaults.update(EMBEDDED_DEFAULTS)
    argv = list(argv) + [x for k, v in defaults.items() if k not in given for x in (f"--{k}", v)]
    parser = HfArgumentParser((FoakArguments, TrainingArguments))
    foak_args, training_args = parser.parse_args_into_dataclasses(argv)
    if foak_args.peft not in ("none", "lora", "qlora-nf4"):
        raise ValueError(f"--peft must be none, lora or qlora-nf4, got {foak_args.peft!r}")
    return foak_args, training_args


def _mixed_precision(training_args) -> str:
    return "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "no"


def _dtype(training_args) -> torch.dtype:
    return torch.bfloat16 if training_args.bf16 else torch.float16 if training_args.fp16 else torch.float32


def gptq_checkpoint(foak_args) -> dict | None:
    """The ``quantization_config`` of a ``--model`` directory whose config.json says ``quant_method: gptq``
    (None for any other model). A GPTQ base is frozen 4-bit: only ``--peft lora`` can train it (ValueError
    otherwise)."""
    import json

    if foak_args.model is None:
        return None
    config_path = Path(foak_args.model) / "config.json"
    if not config_path.is_file():
        return None
    try:
        qc = json.loads(config_path.read_text()).get("quantization_config")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"--model {foak_args.model}: config.json is not a JSON object ({e})") from e
    if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() != "gptq":
        return None
    if foak_args.peft == "none":
        raise ValueError(
            f"--model {foak_args.model} is a GPTQ 4-bit checkpoint: its quantized weights are frozen, so it "
            "cannot be fully fine-tuned; pass --peft lora to train LoRA adapters on it")
    if foak_args.peft == "qlora-nf4":
        raise ValueError(
            f"--model {foak_args.model} is a GPTQ 4-bit checkpoint, already quantized: --peft qlora-nf4 would "
            "quantize a dense model with bitsandbytes NF4; pass --peft lora to train LoRA adapters on the GPTQ "
            "base")
    return qc


def _load_kwargs(foak_args, training_args) -> dict:
    """from_pretrained's dtype and, for --peft qlora-nf4, the NF4 BitsAndBytesConfig."""
    import transformers

    dtype = _dtype(training_args)
    kwargs = {"dtype": dtype}
    if foak_args.peft == "qlora-nf4":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise ValueError("--peft qlora-nf4 needs bitsandbytes (pip install bitsandbytes)") from e
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype)
    return kwargs


def load_model_and_tokenizer(foak_args, training_args):
    import transformers

    if foak_args.model is None:
        from foak.models.tiny import tiny_config

        tokenizer = char_tokenizer()
        config = tiny_config("llama")
        config.vocab_size = len(tokenizer)
        config.max_position_embeddings = max(foak_args.max_seq_length, 64)
        config.pad_token_id, config.bos_token_id, config.eos_token_id = (
            tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
        torch.manual_seed(training_args.seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        name = "tiny Llama (2 layers, hidden 64, built from a config)"
        if foak_args.peft == "qlora-nf4":
            # from_config does not quantize: the tiny model is saved to a temporary directory and loaded back
            # through from_pretrained with the BitsAndBytesConfig, as a --model of the user's would be
            import tempfile

            kwargs = _load_kwargs(foak_args, training_args)
            with tempfile.TemporaryDirectory(prefix="foak-tiny-") as tmp:
                model.save_pretrained(tmp)
                model = transformers.AutoModelForCausalLM.from_pretrained(tmp, **kwargs)
            model.name_or_path = model.config.name_or_path = ""  # as from_config: the temporary directory is gone
            name = "tiny Llama (2 layers, hidden 64, built from a config, NF4-quantized by bitsandbytes)"
        return model, tokenizer, name
    path = Path(foak_args.model)
    if not path.exists():
        raise ValueError(f"--model {foak_args.model}: no such local path (foak train does not download models)")
    gptq = gptq_checkpoint(foak_args)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if gptq is not None:
        # foak's own loader: transformers' from_pretrained would need gptqmodel for a GPTQ checkpoint
        from foak.quant import load_gptq

        dtype = _dtype(training_args)
        model = load_gptq(path, dtype=dtype)
        return model, tokenizer, (f"{path} (GPTQ 4-bit checkpoint, group_size {gptq.get('group_size', 128)}, "
                                  f"loaded by foak.quant.load_gptq computing in {str(dtype).removeprefix('torch.')})")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **_load_kwargs(foak_args, training_args))
    return model, tokenizer, str(path)


def apply_peft(model, foak_args):
    if foak_args.peft == "none":
        return model
    from torch import nn

    from foak.quant.gptq import GPTQLinear

    linear_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                    if isinstance(m, (nn.Linear, GPTQLinear))}
    gptq = any(isinstance(m, GPTQLinear) for m in model.modules())
    unknown = sorted(set(foak_args.target_modules) - linear_names)
    if unknown:
        raise ValueError(
            f"--target_modules {unknown} match no linear layer of this model; its linear layers are "
            f"{sorted(linear_names)}"
        )
    import peft

    if foak_args.peft == "qlora-nf4":
        model = peft.prepare_model_for_kbit_training(
            model, gradient_checkpointing_kwargs={"use_reentrant": False})
    config = peft.LoraConfig(r=foak_args.lora_r, lora_alpha=foak_args.lora_alpha,
                             lora_dropout=foak_args.lora_dropout, target_modules=foak_args.target_modules,
                             task_type="CAUSAL_LM")
    if gptq:  # PEFT wraps GPTQLinear only through the custom-module mapping (foak's GPTQLoraLinear)
        from foak.quant.gptq_peft import register_gptq_lora

        register_gptq_lora(config)
    return peft.get_peft_model(model, config)


def plot_loss(log_history, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(h["step"], h["loss"]) for h in log_history if "loss" in h]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("foak train")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _peak_memory_gib() -> tuple[float, str]:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30, "GPU max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "process max RSS"


def resolve_config(foak_args, embedded: bool):
    """The AccelerationConfig to patch with (None: train without foak): the YAML given, else the default of the
    module docstring."""
    from foak.config import FULL_STANZA, PEFT_STANZA, load_config

    given = foak_args.acceleration_config
    if given == "none":
        return None
    if given is None:
        if foak_args.peft != "none":
            return load_config(PEFT_KERNELS)
        return load_config(EMBEDDED_KERNELS) if embedded else None
    config = load_config(given)
    # the stanza says full fine-tuning or PEFT: it must be the run's (foak.patch would take a training stanza
    # on a PEFT model, leave its LoRA layers unfused and check the precision as for full fine-tuning)
    if foak_args.peft != "none" and config.mode == "full":
        raise ValueError(
            f"--peft {foak_args.peft} with --acceleration_config {given}: its {FULL_STANZA} stanza is for full "
            f"fine-tuning, where foak's fused LoRA (fused_lora) does not exist. For a LoRA/QLoRA run put the "
            f"switches under {PEFT_STANZA} and add fused_lora: true (fused_lora: false keeps PEFT's own LoRA "
            "forward), or leave --acceleration_config out for the default (fused_lora and every kernel)"
        )
    if foak_args.peft == "none" and config.mode == "peft":
        raise ValueError(
            f"--acceleration_config {given} has the {PEFT_STANZA} stanza (LoRA/QLoRA) but --peft is none (full "
            f"fine-tuning): pass --peft lora or --peft qlora-nf4, or put the switches under {FULL_STANZA} "
            "(without fused_lora and base_layer)"
        )
    return config


def _check_architecture(model, foak_args) -> None:
    """The default config on a model foak has no rules for: say how to train it anyway."""
    from foak.models import ARCHITECTURES

    model_type = getattr(model.config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"--model {foak_args.model}: foak has no kernels for model_type {model_type!r} (supported: "
            f"{', '.join(sorted(ARCHITECTURES))}); pass --acceleration_config none to train it without foak"
        )


def fused_lora_calls(report) -> dict | None:
    """The report's fused_lora counts: modules patched, calls foak's fused op ran, calls that took PEFT's own
    forward (total and per reason), and the rows' notes (e.g. LoRA layers left to PEFT). None without a
    fused_lora row."""
    from foak.patching.peft import fused_lora_counts

    rows = [r for r in report.results if r.switch == "lora"]
    if not rows:
        return None
    fused, reasons = 0, {}
    for row in rows:
        row_fused, row_reasons = fused_lora_counts(report, row.rule_id)
        fused += row_fused
        for why, n in row_reasons.items():
            reasons[why] = reasons.get(why, 0) + n
    layer_rows = [r for r in rows if r.rule_id.endswith(".fused_lora")]  # not the q/k/v block rows
    return {"modules": sum(r.modules for r in layer_rows), "fused": fused, "peft_path": sum(reasons.values()),
            "peft_path_reasons": reasons, "notes": "; ".join(r.notes for r in rows if r.notes)}


def train(argv: list[str]) -> dict:
    """Run ``foak train`` with command-line ``argv``; returns the summary dict (with ``patch_report``, the
    report's text after training, and ``fused_lora``, see :func:`fused_lora_calls`; both None without foak)."""
    from transformers import Trainer

    import foak
    from foak.backend import describe

    foak_args, training_args = parse_arguments(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = describe(device)
    if device.type == "cpu":
        how = ("the Triton interpreter (TRITON_INTERPRET=1: exact but slow)" if backend != "reference"
               else "the reference torch ops")
        print(f"No GPU: foak's Triton kernels need a CUDA GPU; on this CPU the patched model runs {how}.")
    # everything the user gave is checked before the model is built
    records = read_jsonl(foak_args.dataset, foak_args.text_field) if foak_args.dataset else generated_corpus()
    embedded = foak_args.model is None and foak_args.dataset is None
    gptq_checkpoint(foak_args)  # a GPTQ --model needs --peft lora
    config = resolve_config(foak_args, embedded)
    model, tokenizer, model_name = load_model_and_tokenizer(foak_args, training_args)
    dataset = tokenize(records, tokenizer, foak_args.max_seq_length, foak_args.text_field)
    print(f"model: {model_name}; dataset: {foak_args.dataset or 'generated corpus'} ({len(dataset)} "
          f"sequences, {dataset.n_tokens} tokens"
          + (f", {dataset.truncated} truncated to max_seq_length={foak_args.max_seq_length}" if dataset.truncated
             else "") + ")")
    model.config.use_cache = False  # training needs no KV cache (and packing requires none)
    if config is not None and foak_args.acceleration_config is None:
        _check_architecture(model, foak_args)
    model = apply_peft(model, foak_args)
    report = None
    if config is None:
        why = ("--acceleration_config none" if foak_args.acceleration_config == "none"
               else "no --acceleration_config for full fine-tuning of a model or dataset of yours")
        print(f"{why}: training without foak's kernels (the baseline)")
    else:
        report = foak.patch(model, config, mixed_precision=_mixed_precision(training_args))
        print(report)
    collator = TokenCounter(PackingCollator() if foak_args.packing else PaddingCollator(tokenizer.pad_token_id))
    if training_args.gradient_checkpointing:
        training_args.gradient_checkpointing_kwargs = {"use_reentrant": False}
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=collator)
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    if report is not None:
        print(f"after training:\n{report}")  # the fused_lora row now counts the calls
    output_dir = Path(training_args.output_dir)
    trainer.save_model(str(output_dir))
    tokenizer.save_pretrained(str(output_dir))
    # logged losses (every logging_steps); a run shorter than one logging interval has only its average
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h] or [result.training_loss]
    plot_loss(trainer.state.log_history, output_dir / "loss_curve.png")
    peak, peak_kind = _peak_memory_gib()
    summary = {"steps": result.global_step, "seconds": seconds, "tokens": collator.tokens,
               "tokens_per_second": collator.tokens / seconds, "peak_memory_gib": peak,
               "first_loss": losses[0] if losses else math.nan, "final_loss": losses[-1] if losses else math.nan,
               "output_dir": str(output_dir), "patch_report": None if report is None else str(report),
               "fused_lora": None if report is None else fused_lora_calls(report)}
    print(f"done: {summary['steps']} steps in {seconds:.1f} s, {summary['tokens_per_second']:.0f} tokens/s, "
          f"peak memory {peak:.2f} GiB ({peak_kind}), loss {summary['first_loss']:.3f} -> "
          f"{summary['final_loss']:.3f}; model and loss_curve.png in {output_dir}")
    sys.stdout.flush()
    return summary
