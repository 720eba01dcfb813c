"""``foak train``: fine-tune a causal LM with HF Trainer, foak's kernels patched in by the acceleration
config. Arguments are HF ``TrainingArguments`` names plus :class:`FoakArguments`. With no model and no
dataset it trains the embedded default: a tiny Llama built from a config, a character tokenizer and a
generated corpus, all made locally."""

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
# the embedded default shows every kernel foak has for its tiny Llama
EMBEDDED_KERNELS = {"training": {"fused_ops_and_kernels": {
    "fast_rms_layernorm": True, "fast_rope_embeddings": True, "fast_swiglu": True, "fused_linear_loss": True}}}
EMBEDDED_DEFAULTS = {"max_steps": "60", "learning_rate": "3e-3", "warmup_steps": "5",
                     "per_device_train_batch_size": "16"}


@dataclass
class FoakArguments:
    model: str | None = field(default=None, metadata={"help": "local path of an HF causal LM (default: tiny)"})
    dataset: str | None = field(default=None, metadata={"help": "JSONL file: {'text': ...} or {'prompt', 'response'}"})
    text_field: str = field(default="text", metadata={"help": "the JSONL field holding plain text"})
    max_seq_length: int = field(default=128, metadata={"help": "longer sequences are truncated (and counted)"})
    packing: bool = field(default=False, metadata={"help": "padding-free packing with restarting position_ids"})
    peft: str = field(default="none", metadata={"help": "none | lora | qlora-nf4"})
    lora_r: int = 16
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    acceleration_config: str | None = field(
        default=None,
        metadata={"help": "foak YAML (see README); 'none' trains without foak. Default: every kernel for the "
                          "embedded tiny model, none for a model of yours"},
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
        return model, tokenizer, "tiny Llama (2 layers, hidden 64, built from a config)"
    path = Path(foak_args.model)
    if not path.exists():
        raise ValueError(f"--model {foak_args.model}: no such local path (foak train does not download models)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = torch.bfloat16 if training_args.bf16 else torch.float16 if training_args.fp16 else torch.float32
    kwargs = {"dtype": dtype}
    if foak_args.peft == "qlora-nf4":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise ValueError("--peft qlora-nf4 needs bitsandbytes (pip install bitsandbytes)") from e
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model, tokenizer, str(path)


def apply_peft(model, foak_args):
    if foak_args.peft == "none":
        return model
    from torch import nn

    linear_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
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


def train(argv: list[str]) -> dict:
    """Run ``foak train`` with command-line ``argv``; returns the summary dict."""
    from transformers import Trainer

    import foak
    from foak.backend import describe
    from foak.config import load_config

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
    if foak_args.acceleration_config in (None, "none"):
        config = EMBEDDED_KERNELS if embedded and foak_args.acceleration_config is None else None
    else:
        config = load_config(foak_args.acceleration_config)
    model, tokenizer, model_name = load_model_and_tokenizer(foak_args, training_args)
    dataset = tokenize(records, tokenizer, foak_args.max_seq_length, foak_args.text_field)
    print(f"model: {model_name}; dataset: {foak_args.dataset or 'generated corpus'} ({len(dataset)} "
          f"sequences, {dataset.n_tokens} tokens"
          + (f", {dataset.truncated} truncated to max_seq_length={foak_args.max_seq_length}" if dataset.truncated
             else "") + ")")
    model.config.use_cache = False  # training needs no KV cache (and packing requires none)
    model = apply_peft(model, foak_args)
    if config is None:
        print("no --acceleration_config: training without foak's kernels (the baseline)")
    else:
        print(foak.patch(model, config, mixed_precision=_mixed_precision(training_args)))
    collator = TokenCounter(PackingCollator() if foak_args.packing else PaddingCollator(tokenizer.pad_token_id))
    if training_args.gradient_checkpointing:
        training_args.gradient_checkpointing_kwargs = {"use_reentrant": False}
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=collator)
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
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
               "output_dir": str(output_dir)}
    print(f"done: {summary['steps']} steps in {seconds:.1f} s, {summary['tokens_per_second']:.0f} tokens/s, "
          f"peak memory {peak:.2f} GiB ({peak_kind}), loss {summary['first_loss']:.3f} -> "
          f"{summary['final_loss']:.3f}; model and loss_curve.png in {output_dir}")
    sys.stdout.flush()
    return summary
