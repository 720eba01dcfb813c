"""``foak train``: fine-tune a causal LM with HF Trainer, foak's kernels patched in. Arguments are HF
``TrainingArguments`` names (underscores or dashes) plus :class:`FoakArguments`; ``foak train --help`` shows
foak's options and the common TrainingArguments with foak's defaults, ``--help_all`` every one. With no model
and no dataset it trains the embedded default: a tiny Llama built from a config, a character tokenizer and a
generated corpus, all made locally.

Kernels: without ``--acceleration_config`` every switch foak has for the model's architecture
(:func:`foak.api.default_config`: RMSNorm, RoPE, SwiGLU and the fused linear+loss where the architecture
has them, plus ``fused_lora`` with ``--peft lora`` / ``qlora-nf4``); the patch report says which.
``--acceleration_config none`` trains without foak (the baseline); a YAML chooses the switches itself, and its
stanza must match ``--peft`` (``training`` for ``--peft none``, ``peft`` otherwise). An architecture foak has
no rules for is an error before any data is read, unless ``--acceleration_config none``.

Precision follows HF: ``--bf16`` / ``--fp16`` are autocast (fp16 with a GradScaler) over the weights, which are
loaded in fp32 (master weights) unless ``--torch_dtype`` says otherwise (``--torch_dtype bfloat16``: pure bf16
weights). A quantized base (``--peft qlora-nf4``, a GPTQ checkpoint) loads in the autocast dtype, which is
bitsandbytes' compute dtype. ``--seed`` seeds python, numpy and torch before the model and any adapter are
built, so identical runs give identical losses.

A ``--model`` is a local directory or a hub id (:mod:`foak.model_source`, checked before anything is loaded).
One whose config.json has ``quantization_config.quant_method: gptq`` (e.g. written by
:func:`foak.quant.save_gptq`) is loaded by :func:`foak.quant.load_gptq` (its 4-bit linears become foak's
``GPTQLinear``; transformers' own GPTQ path, which needs gptqmodel, is not used) and trained with ``--peft lora``
only: PEFT wraps the GPTQ layers with foak's ``GPTQLoraLinear`` (:func:`foak.quant.gptq_peft.register_gptq_lora`)
and the default config's fused_lora takes them. Beside the adapter goes ``foak_gptq_base.json`` (the base and
the compute dtype): ``foak.quant.load_gptq(<output dir>)`` loads the trained model back.

Output goes through Python logging (logger ``foak``, to stdout; ``--log_level``). The patch report is logged
before training and again after it, when the ``fused_lora`` row holds the call counts (fused calls, calls
that took PEFT's own forward and why). The summary counts exactly the micro-batches trained (tokens/s), and
its first loss is step 1's own loss (not a logging-interval mean), averaged over the ranks as HF's logged
loss is. Rank 0 writes it to ``train_summary.json`` in the output directory, beside HF's
``trainer_state.json``.

Under ``torchrun`` or ``accelerate launch`` (DDP, or FSDP2 through accelerate's FSDP plugin or ``--fsdp
--fsdp_config``; docs/distributed.md) every rank builds and patches its own model before the Trainer wraps
it; rank 0 alone logs the patch report and the summary, whose token counts are all ranks' together."""

from __future__ import annotations

import logging
import math
import resource
import sys
import time
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

# foak train's command line, its --help and the early checks (light: no torch, no transformers), re-exported
from foak.train_cli import (  # noqa: F401
    COMMON_TRAINING_ARGUMENTS,
    DEFAULT_TARGETS,
    DESCRIPTION,
    DTYPE_CHOICES,
    EMBEDDED_DEFAULTS,
    EXAMPLES,
    LONG_CONTEXT_SWITCHES,
    PEFT_CHOICES,
    TRAINER_DEFAULTS,
    CheckedRun,
    FoakArguments,
    _checkpointing_given_as,
    _given_checkpointing,
    _is_embedded,
    _unknown_arguments_error,
    _usage_error,
    check_architecture,
    check_arguments,
    gptq_checkpoint,
    help_text,
    long_context_switches,
    parse_foak_arguments,
    resolve_config,
    setup_logging,
)

log = logging.getLogger("foak.train")

# the default targets of a model that fuses some of them into one projection (Phi-3's qkv_proj, gate_up_proj)
_FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def build_parser(embedded: bool):
    """HfArgumentParser over FoakArguments and TrainingArguments with foak's defaults (argparse defaults, so a
    value the command line gives always wins). Argument errors raise ValueError (one line, no usage dump)."""
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser((FoakArguments, TrainingArguments), prog="foak train", allow_abbrev=False,
                              description=DESCRIPTION, epilog=EXAMPLES)
    parser.error = _usage_error
    cuda = torch.cuda.is_available()  # without a GPU: no pinned memory, and bf16 autocast on the CPU
    defaults = {**TRAINER_DEFAULTS, "dataloader_pin_memory": cuda, "use_cpu": not cuda}
    if embedded:
        defaults.update(EMBEDDED_DEFAULTS)
    parser.set_defaults(**defaults)
    return parser


def parse_arguments(argv: list[str]):
    """(FoakArguments, TrainingArguments) of a ``foak train`` command line; ValueError for a bad one."""
    foak_args = parse_foak_arguments(argv)  # foak's checks first, without transformers
    return foak_args, parse_training_arguments(argv, foak_args)


def parse_training_arguments(argv: list[str], foak_args):
    """The TrainingArguments of a ``foak train`` command line, parsed by HF's own parser with foak's defaults
    (``foak_args``: the command line's checked FoakArguments; its gradient checkpointing resolved)."""
    argv = list(argv)
    parser = build_parser(_is_embedded(argv))
    _, training_args, remaining = parser.parse_args_into_dataclasses(
        argv, return_remaining_strings=True, look_for_args_file=False)
    if remaining:
        raise _unknown_arguments_error(parser, remaining)
    resolve_gradient_checkpointing(argv, foak_args, training_args)
    return training_args


def resolve_gradient_checkpointing(argv: list[str], foak_args, training_args) -> None:
    """Gradient checkpointing as the user asked; not asked: on for --peft qlora-nf4 (a QLoRA run is one that
    saves memory: the quantized base leaves the activations as the largest part) and --long_context, off
    otherwise (HF's default). Sets TrainingArguments' flag, so the Trainer turns it on (non-reentrant) or
    leaves it off."""
    given = _given_checkpointing(argv)
    if foak_args.long_context and given is False:
        raise ValueError("--long_context needs gradient checkpointing (its offloading keeps the checkpointed layers' "
                         f"inputs): drop {_checkpointing_given_as(argv)}")
    on = given if given is not None else (foak_args.peft == "qlora-nf4" or foak_args.long_context)
    training_args.activation_checkpointing = training_args.gradient_checkpointing = bool(on)
    # transformers >= 5.24 names them activation_checkpointing*, 5.17 gradient_checkpointing* only
    kwargs = getattr(training_args, "activation_checkpointing_kwargs", None) or \
        training_args.gradient_checkpointing_kwargs
    if on and not kwargs:
        if hasattr(training_args, "activation_checkpointing_kwargs"):
            training_args.activation_checkpointing_kwargs = {"use_reentrant": False}
        training_args.gradient_checkpointing_kwargs = {"use_reentrant": False}


# ---- precision ------------------------------------------------------------------------------------------
def _mixed_precision(training_args) -> str:
    return "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "no"


def _autocast_dtype(training_args) -> torch.dtype | None:
    return torch.bfloat16 if training_args.bf16 else torch.float16 if training_args.fp16 else None


def weights_dtype(foak_args, training_args, quantized: bool = False) -> torch.dtype:
    """The dtype the weights are loaded in: --torch_dtype; else fp32 (master weights under --bf16/--fp16
    autocast), or for a quantized base (NF4, GPTQ) the autocast dtype (fp32 without one)."""
    if foak_args.torch_dtype is not None:
        return getattr(torch, foak_args.torch_dtype)
    if quantized:
        return _autocast_dtype(training_args) or torch.float32
    return torch.float32


def _quantized(foak_args, gptq) -> bool:
    return foak_args.peft == "qlora-nf4" or gptq is not None


def check_run_precision(foak_args, training_args, gptq) -> None:
    """The weights' dtype against --bf16/--fp16 (foak.config.check_precision's matrix), before anything loads."""
    from foak.config import check_precision

    dtype = weights_dtype(foak_args, training_args, _quantized(foak_args, gptq))
    try:
        check_precision(dtype, _mixed_precision(training_args), peft=foak_args.peft != "none")
    except ValueError as e:
        flags = f"--torch_dtype {str(dtype).removeprefix('torch.')}"
        flags += {"bf16": " with --bf16", "fp16": " with --fp16"}.get(_mixed_precision(training_args), "")
        raise ValueError(f"{flags}: {e}") from None


# ---- the model --------------------------------------------------------------------------------------------
def _load_kwargs(foak_args, training_args) -> dict:
    """from_pretrained's dtype and, for --peft qlora-nf4, the NF4 BitsAndBytesConfig (compute dtype: the
    autocast dtype, else the weights')."""
    import transformers

    dtype = weights_dtype(foak_args, training_args, quantized=foak_args.peft == "qlora-nf4")
    kwargs = {"dtype": dtype}
    if foak_args.peft == "qlora-nf4":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ValueError("--peft qlora-nf4 needs bitsandbytes: pip install bitsandbytes"
                             " (foak's train extra has it)") from None
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=_autocast_dtype(training_args) or dtype)
    return kwargs


def _loader_error(source, what: str, e: Exception) -> ValueError:
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return ValueError(f"--model {source.given}: transformers could not load its {what}: {first}")


def load_model_and_tokenizer(foak_args, training_args, source=None):
    """(model, tokenizer, description). ``source``: the checked --model (:func:`foak.model_source.resolve_model`;
    resolved here when not given)."""
    import transformers

    if foak_args.model is None:
        from foak.models.tiny import model_from_config, tiny_config

        tokenizer = char_tokenizer()
        if foak_args.max_seq_length is None:
            foak_args.max_seq_length = EMBEDDED_MAX_SEQ_LENGTH
        arch = foak_args.arch or "llama"
        config = tiny_config(arch)
        for part in {id(c): c for c in (config, config.get_text_config())}.values():  # multimodal: its text model
            part.vocab_size = len(tokenizer)
            part.max_position_embeddings = max(foak_args.max_seq_length, 64)
            part.pad_token_id, part.bos_token_id, part.eos_token_id = (
                tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
        torch.manual_seed(training_args.seed)
        model = model_from_config(config)
        label = "Llama" if arch == "llama" else arch
        name = f"tiny {label} (2 layers, hidden 64, built from a config)"
        if foak_args.peft == "qlora-nf4":
            # from_config does not quantize: the tiny model is saved to a temporary directory and loaded back
            # through from_pretrained with the BitsAndBytesConfig, as a --model of the user's would be
            import tempfile

            kwargs = _load_kwargs(foak_args, training_args)
            with tempfile.TemporaryDirectory(prefix="foak-tiny-") as tmp:
                model.save_pretrained(tmp)
                model = type(model).from_pretrained(tmp, **kwargs)
            model.name_or_path = model.config.name_or_path = ""  # as from_config: the temporary directory is gone
            name = f"tiny {label} (2 layers, hidden 64, built from a config, NF4-quantized by bitsandbytes)"
        else:
            model = model.to(weights_dtype(foak_args, training_args))
        return model, tokenizer, name
    if source is None:
        from foak.model_source import resolve_model

        source = resolve_model(foak_args.model)
    gptq = gptq_checkpoint(foak_args, source.config)
    hub = {"local_files_only": True} if source.local_files_only else {}
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source.ref, **hub)
    except (OSError, ValueError, ImportError, KeyError) as e:
        raise _loader_error(source, "tokenizer", e) from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if gptq is not None:
        # foak's own loader: transformers' from_pretrained would need gptqmodel for a GPTQ checkpoint
        from foak.quant import load_gptq

        dtype = weights_dtype(foak_args, training_args, quantized=True)
        model = load_gptq(source.local_dir(), dtype=dtype)
        model.name_or_path = source.ref  # what a saved adapter records as its base
        return model, tokenizer, (f"{source} (GPTQ 4-bit checkpoint, group_size {gptq.get('group_size', 128)}, "
                                  f"loaded by foak.quant.load_gptq computing in {str(dtype).removeprefix('torch.')})")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source.ref, **_load_kwargs(foak_args, training_args), **hub)
    except (OSError, ValueError, ImportError, KeyError) as e:
        if "bitsandbytes" in str(e) and foak_args.peft == "qlora-nf4":
            raise
        raise _loader_error(source, "model", e) from e
    return model, tokenizer, str(source)


# multi-head latent attention's projections (DeepSeek-V3, GLM-4-MoE-Lite), targeted by default where the model has them
_MLA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def default_targets(linear_names) -> list[str]:
    """The DEFAULT_TARGETS the model has as linear layers, with a fused projection in place of the ones it fuses
    where the model has it and not them, and MLA's projections where it has them; a model with none of them:
    every linear layer but the LM head. An MoE model's experts are 3-D parameters, not linear layers: only its
    dense and shared MLPs' projections are targets."""
    targets = list(DEFAULT_TARGETS)
    for fused, parts in _FUSED_TARGETS.items():
        if fused in linear_names and not any(p in linear_names for p in parts):
            at = targets.index(parts[0])
            targets = [*targets[:at], fused, *[t for t in targets[at:] if t not in parts]]
    at = targets.index("o_proj")
    targets = [*targets[:at], *[t for t in _MLA_TARGETS if t in linear_names], *targets[at:]]
    targets = [t for t in targets if t in linear_names]
    # a model that names its projections otherwise (GPTBigCode's c_attn, c_proj, c_fc): every linear layer but
    # the LM head, as PEFT's "all-linear"
    return targets or sorted(set(linear_names) - {"lm_head"})


def apply_peft(model, foak_args, gradient_checkpointing: bool = False):
    """PEFT's LoRA over ``model`` for --peft lora / qlora-nf4 (the model itself for none). For qlora-nf4,
    PEFT's prepare_model_for_kbit_training turns gradient checkpointing on only when ``gradient_checkpointing``
    (the run's resolved --gradient_checkpointing)."""
    if foak_args.peft == "none":
        return model
    from torch import nn

    from foak.quant.gptq import GPTQLinear

    linear_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                    if isinstance(m, (nn.Linear, GPTQLinear))}
    gptq = any(isinstance(m, GPTQLinear) for m in model.modules())
    targets = default_targets(linear_names) if foak_args.target_modules == DEFAULT_TARGETS else foak_args.target_modules
    if not targets:
        raise ValueError("the model has no linear layer but its LM head for LoRA adapters; pass --target_modules")
    if foak_args.target_modules == DEFAULT_TARGETS and targets != DEFAULT_TARGETS:
        log.info(f"LoRA targets: {', '.join(targets)} (the default targets this model has as linear layers)")
    unknown = sorted(set(targets) - linear_names)
    if unknown:
        raise ValueError(
            f"--target_modules {unknown} match no linear layer of this model; its linear layers are "
            f"{sorted(linear_names)}"
        )
    try:
        import peft
    except ImportError:
        raise ValueError(f"--peft {foak_args.peft} needs peft: pip install peft (foak's train extra has it)") from None

    if foak_args.peft == "qlora-nf4":
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    config = peft.LoraConfig(r=foak_args.lora_r, lora_alpha=foak_args.lora_alpha,
                             lora_dropout=foak_args.lora_dropout, target_modules=targets,
                             task_type="CAUSAL_LM")
    if gptq:  # PEFT wraps GPTQLinear only through the custom-module mapping (foak's GPTQLoraLinear)
        from foak.quant.gptq_peft import register_gptq_lora

        register_gptq_lora(config)
    return peft.get_peft_model(model, config)


# ---- the acceleration config --------------------------------------------------------------------------------
EMBEDDED_MAX_SEQ_LENGTH = 128
MAX_SEQ_LENGTH_CAP = 4096  # the default's cap: a longer context is a choice (--max_seq_length, --long_context)


def default_max_seq_length(model, tokenizer, long_context: bool) -> tuple[int, str]:
    """(the --max_seq_length a run without one uses, how it was chosen)."""
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    tokenizer_max = getattr(tokenizer, "model_max_length", None)
    limits = [n for n in (context, tokenizer_max) if isinstance(n, int) and 0 < n < 10**8]
    if not limits:
        return MAX_SEQ_LENGTH_CAP, f"the model states no context length: {MAX_SEQ_LENGTH_CAP}"
    n = min(limits)
    if long_context or n <= MAX_SEQ_LENGTH_CAP:
        return n, f"the model's context length, {n}"
    return MAX_SEQ_LENGTH_CAP, (f"the model's context length {n}, capped at {MAX_SEQ_LENGTH_CAP}; pass "
                                "--max_seq_length for more")


def with_long_context(config):
    """``config`` (foak's default for the model) plus :data:`LONG_CONTEXT_SWITCHES`."""
    from foak.config import config_from_kwargs

    switches = {s: True for s in type(config).model_fields if getattr(config, s) is True}
    switches.update({s: True for s in long_context_switches()})
    return config_from_kwargs("peft" if config.mode == "peft" else "full", **switches)


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


# ---- training ---------------------------------------------------------------------------------------------
def _trainer_class():
    from transformers import Trainer

    class FoakTrainer(Trainer):
        """HF Trainer that counts the tokens of every micro-batch it trains and keeps this rank's loss of the
        first and of the latest optimizer step: the sum of its micro-batches' ``training_step`` values in fp32,
        what HF adds to its logged loss (:func:`_step_losses_of_all_ranks` averages it over the ranks as HF's
        logging does)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.foak_tokens = 0
            self.foak_step_losses: dict[int, torch.Tensor] = {}

        def training_step(self, model, inputs, *args, **kwargs):
            mask = inputs.get("attention_mask")
            tokens = mask.sum() if mask is not None else inputs["input_ids"].numel()
            self.foak_tokens = self.foak_tokens + tokens  # a tensor stays on its device: no sync per step
            loss = super().training_step(model, inputs, *args, **kwargs)
            step, losses = self.state.global_step + 1, self.foak_step_losses
            if step in losses:
                losses[step] = losses[step] + loss.detach()
            else:
                for old in sorted(losses)[1:]:  # keep the first step and the current one
                    del losses[old]
                losses[step] = loss.detach().to(torch.float32, copy=True)  # HF's running loss is fp32 too
            return loss

    return FoakTrainer


def plot_loss(log_history, path: Path, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(h["step"], h["loss"]) for h in log_history if "loss" in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean per logging interval)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return title


def _tokens_of_all_ranks(trainer) -> tuple[int, int]:
    """(tokens trained by every process together, number of processes): under DDP / FSDP each rank counts
    its own micro-batches."""
    tokens = trainer.foak_tokens
    world = trainer.args.world_size
    if world > 1:
        tokens = torch.as_tensor(tokens, device=trainer.args.device).reshape(1).long()
        torch.distributed.all_reduce(tokens)
    return int(tokens), world


def write_gptq_base(output_dir: Path, base: str, dtype: torch.dtype, quantization_config: dict) -> None:
    """Beside an adapter trained on a GPTQ base: which base and compute dtype, so that
    ``foak.quant.load_gptq(output_dir)`` rebuilds the trained model (PEFT's own loaders cannot: the GPTQ
    layers need foak's loader and LoRA class)."""
    import json

    from foak.quant.gptq import GPTQ_BASE_NAME

    record = {"base_model_name_or_path": base, "dtype": str(dtype).removeprefix("torch."),
              "quantization_config": quantization_config,
              "load_with": "foak.quant.load_gptq(<this directory>)"}
    (output_dir / GPTQ_BASE_NAME).write_text(json.dumps(record, indent=1) + "\n")


def _step_losses_of_all_ranks(trainer) -> dict[int, float]:
    """The kept steps' losses as HF logs them. Each rank's ``training_step`` returns its own share: with
    ``average_tokens_across_devices`` (HF's default) its token-loss sum over all ranks' tokens, times the world
    size, so one rank alone is not the step's loss; HF's logging gathers every rank's value and takes the mean
    (``nested_gather(tr_loss).mean()``), and so does this (a collective: every rank calls it)."""
    from transformers.trainer_pt_utils import nested_gather

    steps = sorted(trainer.foak_step_losses)
    if not steps:
        return {}
    local = torch.stack([trainer.foak_step_losses[s].reshape(()) for s in steps])
    gathered = nested_gather(local, trainer.args.parallel_mode)
    if gathered.numel() != local.numel():  # [ranks * steps], rank-major
        gathered = gathered.reshape(-1, local.numel()).mean(0)
    return {s: float(v) for s, v in zip(steps, gathered.tolist())}


def _peak_memory_gib() -> tuple[float, str]:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30, "GPU max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "process max RSS"


def _run_title(foak_args, training_args, source, config) -> str:
    model = f"embedded tiny {foak_args.arch or 'Llama'}" if source is None else (source.ref if source.hub else Path(source.ref).name)
    mode = {"none": "full fine-tuning", "lora": f"LoRA r{foak_args.lora_r}",
            "qlora-nf4": f"QLoRA NF4 r{foak_args.lora_r}"}[foak_args.peft]
    precision = {"bf16": "bf16 autocast", "fp16": "fp16 autocast", "no": "no autocast"}[
        _mixed_precision(training_args)]
    if training_args.gradient_checkpointing:
        precision += ", gradient checkpointing"
    if config is None:
        kernels = "baseline (no foak kernels)"
    else:
        where = "" if foak_args.acceleration_config is None else f" ({Path(foak_args.acceleration_config).name})"
        kernels = "foak" + where + ": " + ", ".join(sorted(config.enabled_rules()))
    return f"foak train: {model}, {mode}, {precision}\n{kernels}"


def train(argv: list[str], checked: CheckedRun | None = None) -> dict:
    """Run ``foak train`` with command-line ``argv``; returns the summary dict (with ``patch_report``, the
    report's text after training, and ``fused_lora``, see :func:`fused_lora_calls`, both None without foak;
    ``log_history``, the Trainer's; ``first_loss``, step 1's own loss; ``final_loss``, the last logged one;
    ``gradient_checkpointing``, whether the trained model checkpointed its layers; ``model``, the trained
    model, patched, not in ``train_summary.json``). User errors are ValueErrors (the CLI prints them as one
    line). ``checked``: what :func:`foak.train_cli.check_arguments` found for ``argv`` (the CLI runs it before
    importing this module); checked here when not given."""
    # everything the user gave that can be checked without transformers: before it is imported
    checked = checked or check_arguments(argv)
    foak_args, source, gptq, config = checked.foak_args, checked.source, checked.gptq, checked.config
    import transformers

    import foak
    from foak.backend import describe

    training_args = parse_training_arguments(argv, foak_args)
    setup_logging(training_args.log_level)
    # seeded before the model and any adapter are built (the Trainer seeds again when it is constructed)
    if training_args.full_determinism:
        transformers.enable_full_determinism(training_args.seed)
    else:
        transformers.set_seed(training_args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = describe(device)
    # the rest of what the user gave is checked before the model is built and any data is read
    check_run_precision(foak_args, training_args, gptq)
    if training_args.fp16 and device.type == "cpu":
        raise ValueError("--fp16 needs a CUDA GPU: on CPU accelerate runs neither fp16 autocast nor a GradScaler, "
                         "so the run would silently compute in fp32; use --bf16 (bf16 autocast runs on CPU) or no "
                         "precision flag")
    if device.type == "cpu" and config is not None:
        how = ("the Triton interpreter (TRITON_INTERPRET=1: exact but slow)" if backend != "reference"
               else "the reference torch ops")
        log.info(f"No GPU: foak's Triton kernels need a CUDA GPU; on this CPU the patched model runs {how}.")
    records = read_jsonl(foak_args.dataset, foak_args.text_field) if foak_args.dataset else generated_corpus()
    model, tokenizer, model_name = load_model_and_tokenizer(foak_args, training_args, source)
    if foak_args.max_seq_length is None:
        foak_args.max_seq_length, how = default_max_seq_length(model, tokenizer, foak_args.long_context)
        log.info(f"max_seq_length {foak_args.max_seq_length}: {how}")
    dataset = tokenize(records, tokenizer, foak_args.max_seq_length, foak_args.text_field)
    log.info(f"model: {model_name}; dataset: {foak_args.dataset or 'generated corpus'} ({len(dataset)} "
             f"sequences, {dataset.n_tokens} tokens"
             + (f", {dataset.truncated} truncated to max_seq_length={foak_args.max_seq_length}" if dataset.truncated
                else "") + ")")
    model.config.use_cache = False  # training needs no KV cache (and packing requires none)
    model = apply_peft(model, foak_args, training_args.gradient_checkpointing)
    report = None
    if config is None:
        log.info("--acceleration_config none: training without foak's kernels (the baseline)")
        if foak_args.peft == "qlora-nf4":
            from foak.patching.bnb_cpu import check_model

            check_model(model)  # warns if bitsandbytes' CPU dequantization is wrong here for the model's layers
    else:
        if config == "default":
            from foak.api import default_config

            config = default_config(model)
            if foak_args.long_context:
                config = with_long_context(config)
                log.info(f"--long_context: gradient checkpointing and {', '.join(long_context_switches())}")
            log.info(f"foak kernels: every switch foak has for {model.config.model_type} "
                     f"({', '.join(s for s in type(config).model_fields if getattr(config, s) is True)}); "
                     "--acceleration_config none trains without them")
        report = foak.patch(model, config, mixed_precision=_mixed_precision(training_args))
        log.info(str(report))
    collator = PackingCollator() if foak_args.packing else PaddingCollator(tokenizer.pad_token_id)
    trainer = _trainer_class()(model=model, args=training_args, train_dataset=dataset, data_collator=collator)
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    seconds = time.perf_counter() - start
    if report is not None:
        log.info(f"after training:\n{report}")  # the fused_lora row now counts the calls
    output_dir = Path(training_args.output_dir)
    trainer.save_model(str(output_dir))  # every rank (FSDP gathers the state dict); rank 0 writes
    step_losses = _step_losses_of_all_ranks(trainer)
    first_step = min(step_losses, default=None)
    first_loss = step_losses[first_step] if first_step is not None else math.nan
    # the last logged loss: the mean over the last logging interval (a run shorter than one interval: the last
    # step's own loss)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    if logged:
        final_loss, final_steps = logged[-1]["loss"], logged[-1]["step"]
        interval = final_steps - (logged[-2]["step"] if len(logged) > 1 else 0)
        final_what = f"mean of steps {final_steps - interval + 1}-{final_steps}" if interval > 1 else \
            f"step {final_steps}"
    elif step_losses:
        final_loss, final_what = step_losses[max(step_losses)], f"step {max(step_losses)}"
    else:
        final_loss, final_what = math.nan, "no step"
    title = _run_title(foak_args, training_args, source, None if report is None else config)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(str(output_dir))
        plot_loss(trainer.state.log_history, output_dir / "loss_curve.png", title)
        if gptq is not None:
            write_gptq_base(output_dir, source.ref, weights_dtype(foak_args, training_args, quantized=True), gptq)
    tokens, world = _tokens_of_all_ranks(trainer)
    peak, peak_kind = _peak_memory_gib()
    summary = {"steps": result.global_step, "seconds": seconds, "tokens": tokens, "world_size": world,
               "tokens_per_second": tokens / seconds, "peak_memory_gib": peak,
               "first_loss": first_loss, "final_loss": final_loss, "output_dir": str(output_dir),
               "gradient_checkpointing": any(getattr(m, "gradient_checkpointing", False) is True
                                             for m in model.modules()),
               "plot_title": title, "log_history": trainer.state.log_history,
               "patch_report": None if report is None else str(report),
               "fused_lora": None if report is None else fused_lora_calls(report)}
    if trainer.is_world_process_zero():
        import json

        trainer.save_state()  # HF's trainer_state.json (its log_history holds the logged losses)
        (output_dir / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["model"] = model  # returned, not written: the trained model (under FSDP this rank's shards)
    ranks = f" on {world} processes" if world > 1 else ""
    log.info(f"done: {summary['steps']} steps{ranks} in {seconds:.1f} s, {tokens} tokens, "
             f"{summary['tokens_per_second']:.0f} tokens/s, peak memory {peak:.2f} GiB ({peak_kind}), loss "
             f"{first_loss:.3f} (step {first_step}) -> {final_loss:.3f} ({final_what}); model, loss_curve.png and "
             f"train_summary.json in "
             f"{output_dir}")
    sys.stdout.flush()
    return summary
