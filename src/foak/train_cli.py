"""``foak train``'s command line without torch or transformers: its arguments (:class:`FoakArguments` and the
names of HF's ``TrainingArguments``), ``foak train --help`` and the checks of everything a user can get wrong
before anything heavy is imported (:func:`check_arguments`: the options and their values, ``--model``, the
``--acceleration_config`` YAML, the architecture, the ``--dataset`` path). foak.train imports this module,
then transformers, and parses the TrainingArguments with HF's own parser (the authority on their values).

The TrainingArguments' names, kinds (a flag, one value, a list) and literal defaults are read from the source
of the installed transformers (its ``training_args.py``, parsed, not imported: importing it costs seconds), so
they follow the installed version; when that source cannot be read, unknown options are left to HF's parser."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import logging
import os
import sys
import textwrap
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# TrainingArguments defaults foak sets (argparse defaults: whatever the command line gives wins, in either
# spelling); dataloader_pin_memory (a CUDA GPU is there) and use_cpu (none is) are added
TRAINER_DEFAULTS = {"output_dir": "foak-output", "report_to": "none", "save_strategy": "no",
                    "logging_steps": 5, "per_device_train_batch_size": 8}
# ... and for the embedded default (no --model and no --dataset)
EMBEDDED_DEFAULTS = {"max_steps": 60, "learning_rate": 3e-3, "warmup_steps": 5,
                     "per_device_train_batch_size": 16}
PEFT_CHOICES = ("none", "lora", "qlora-nf4")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
EXAMPLES = """\
examples:
  foak train                                   # the embedded default: tiny Llama, generated corpus, 60 steps
  foak train --model ./my-llama --dataset data.jsonl --bf16 --max_steps 1000 --output_dir out
  foak train --model meta-llama/Llama-3.2-1B --dataset pairs.jsonl --peft lora --lora_r 16
  foak train --model ./my-llama --dataset data.jsonl --acceleration_config none     # the baseline, no foak"""
DESCRIPTION = ("Fine-tune a causal LM with HF Trainer, foak's kernels patched in (by default every kernel foak "
               "has for the model's architecture; the patch report says which). No --model and no --dataset: "
               "the embedded default, a tiny Llama, a character tokenizer and a generated corpus made locally.")

# the switches --long_context adds to foak's default kernels (those this foak has)
LONG_CONTEXT_SWITCHES = ("offload_activations", "tiled_mlp")


@dataclass
class FoakArguments:
    model: str | None = field(default=None, metadata={
        "help": "local directory or hub id (org/name) of an HF causal LM, or a GPTQ 4-bit checkpoint directory "
                "(with --peft lora); default: the embedded tiny Llama"})
    arch: str | None = field(default=None, metadata={
        "help": "model_type of the embedded tiny model (default llama; `foak info` lists them)"})
    dataset: str | None = field(default=None, metadata={
        "help": "JSONL file, one {'text': ...} or {'prompt': ..., 'response': ...} per line (a pair trains on "
                "the response only); default: a generated corpus"})
    text_field: str = field(default="text", metadata={"help": "the JSONL field holding plain text"})
    long_context: bool = field(default=False, metadata={
        "help": "preset: gradient checkpointing + offload_activations + tiled_mlp on foak's defaults"})
    max_seq_length: int | None = field(default=None, metadata={
        "help": "truncate longer sequences; default: the model's context length, capped at 4096 (not with "
                "--long_context)"})
    packing: bool = field(default=False, metadata={
        "help": "padding-free packing: each batch one row, position_ids restarting per sequence"})
    peft: str = field(default="none", metadata={
        "help": "none (full fine-tuning) | lora | qlora-nf4 (LoRA on a bitsandbytes NF4 base): decides full "
                "fine-tuning vs PEFT; with lora/qlora-nf4 the default kernels include fused_lora"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (the scaling is alpha / r)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout probability"})
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS), metadata={
        "help": "names of the linear layers that get LoRA adapters (by default qkv_proj / gate_up_proj in place of "
                "q/k/v_proj / gate/up_proj where the model fuses them, as Phi-3)"})
    acceleration_config: str | None = field(default=None, metadata={
        "help": "foak YAML (README: Patching a model); its stanza must match --peft. none: no foak kernels "
                "(the baseline). Default: every kernel foak has for the model's architecture"})
    torch_dtype: str | None = field(default=None, metadata={
        "help": "float32 | bfloat16 | float16: the dtype the weights are loaded in. Default float32, so --bf16 "
                "/ --fp16 autocast over fp32 master weights (HF's meaning); with a quantized base (qlora-nf4, "
                "GPTQ) the --bf16/--fp16 dtype. bfloat16 without --bf16: pure bf16 training"})

def _usage_error(message: str):
    raise ValueError(message)


def _is_embedded(argv: list[str]) -> bool:
    """No --model and no --dataset on the command line (either spelling, --x=value too)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.error = _usage_error
    pre.add_argument("--model")
    pre.add_argument("--dataset")
    known, _ = pre.parse_known_args(argv)
    return known.model is None and known.dataset is None

def string_to_bool(value):
    """HF's reading of a boolean option's value (hf_argparser.string_to_bool)."""
    if isinstance(value, bool):
        return value
    if value.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if value.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"Truthy value expected: got {value} but expected one of yes/no, true/false, "
                                     "t/f, y/n, 1/0 (case insensitive).")


# ---- HF's TrainingArguments, read from the installed transformers' source ---------------------------------
@dataclass(frozen=True)
class OptionSpec:
    """One dataclass field as HfArgumentParser makes it an option: its option strings, nargs ("?": a flag
    that may take true/false or a value, "+": a list, None: one value) and const, the value's type (int, float,
    string_to_bool or str), its choices where the source lists them, and its default (None where the source
    gives no literal)."""

    name: str
    options: tuple[str, ...]
    nargs: str | None
    type: typing.Any
    default: typing.Any
    const: typing.Any = None
    choices: tuple | None = None
    negation: tuple[str, ...] = ()  # --no_<name> of a boolean field whose default is True


def _union_members(node) -> list[str]:
    """The members of an annotation, in order (``X | Y``, ``Optional[X]``, ``Union[X, Y]``), as source text."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union_members(node.left) + _union_members(node.right)
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("Optional", "typing.Optional"):
        return [*_union_members(node.slice), "None"]
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("Union", "typing.Union"):
        members = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return [m for e in members for m in _union_members(e)]
    text = ast.unparse(node)
    return ["None" if text in ("NoneType", "type(None)") else text]


def _literal(node, default=None):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return default


def _spec_of_field(name: str, annotation, value, class_names: dict) -> OptionSpec | None:
    """What HfArgumentParser._parse_dataclass_field makes of a field (None: not an init field): the field's
    metadata is argparse keywords too (help, nargs, const, choices, aliases)."""
    metadata = {}
    if isinstance(value, ast.Call) and ast.unparse(value.func) in ("field", "dataclasses.field"):
        keywords = {k.arg: k.value for k in value.keywords}
        if _literal(keywords.get("init"), True) is False:
            return None
        factory = ast.unparse(keywords["default_factory"]) if "default_factory" in keywords else None
        value = keywords.get("default", ast.Constant({"list": [], "dict": {}}.get(factory)))
        if isinstance(keywords.get("metadata"), ast.Dict):
            node = keywords["metadata"]
            metadata = {_literal(k): _literal(v, _literal) for k, v in zip(node.keys, node.values)}
            metadata = {k: v for k, v in metadata.items() if v is not _literal}  # the keys readable as literals
    if isinstance(value, ast.Name) and value.id in class_names:  # e.g. default=default_optim
        value = class_names[value.id]
    default = _literal(value) if value is not None else None
    members = _union_members(annotation)
    if len(members) > 1:  # HF keeps one type of a Union: the same choice here
        if "None" not in members:
            members = [members[0] if members[1] == "str" else members[1]]
        elif "bool" not in members:
            members = [members[0] if members[1] == "None" else members[1]]
    kind = members[0] if len(members) == 1 else "bool" if set(members) == {"bool", "None"} else "str"
    options = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    aliases = metadata.get("aliases", [])
    options += [aliases] if isinstance(aliases, str) else list(aliases)
    nargs, const, value_type, negation = metadata.get("nargs"), metadata.get("const"), str, ()
    if kind == "bool":
        value_type = string_to_bool
        if len(members) == 1 or default is not None:  # HF: a bare flag (const True) unless Optional with None
            nargs, const = "?", True
        if default is True:
            negation = (f"--no_{name}", f"--no-{name.replace('_', '-')}")
    elif kind.startswith(("list[", "List[", "typing.List[")):
        nargs = "+"
        item = kind[kind.index("[") + 1:-1]
        value_type = {"int": int, "float": float}.get(item, str)
    else:
        value_type = {"int": int, "float": float}.get(kind, str)
    choices = metadata.get("choices")
    choices = tuple(choices) if isinstance(choices, (list, tuple)) else None
    return OptionSpec(name, tuple(options), nargs, value_type, default, const, choices, negation)


@lru_cache(maxsize=1)
def training_argument_specs() -> tuple[OptionSpec, ...] | None:
    """Every init field of the installed transformers' TrainingArguments as :class:`OptionSpec`, read from its
    source without importing it; None where it cannot be read (then HF's parser alone checks those options)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("transformers")  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            return None
        source = Path(list(spec.submodule_search_locations)[0], "training_args.py").read_text()
        cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "TrainingArguments")
    except (OSError, SyntaxError, StopIteration, ValueError, ImportError):
        return None
    class_names = {}  # names the class body binds to a literal (the last binding: e.g. default_optim)
    specs = []
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and isinstance(node.value, ast.Constant):
            class_names[node.targets[0].id] = node.value
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if ast.unparse(node.annotation).startswith(("ClassVar", "typing.ClassVar")):
                continue
            option = _spec_of_field(node.target.id, node.annotation, node.value, class_names)
            if option is not None:
                specs.append(option)
    return tuple(specs) if specs else None


# ---- the light parser ---------------------------------------------------------------------------------------
def _foak_specs() -> list[OptionSpec]:
    """FoakArguments' fields as HfArgumentParser makes them options."""
    hints = typing.get_type_hints(FoakArguments)
    specs = []
    for f in dataclasses.fields(FoakArguments):
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        base = args[0] if args and typing.get_origin(kind) is not list else kind
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        options = (f"--{f.name}",) + ((f"--{f.name.replace('_', '-')}",) if "_" in f.name else ())
        if base is bool:
            specs.append(OptionSpec(f.name, options, "?", string_to_bool, default, const=True))
        elif typing.get_origin(base) is list:
            specs.append(OptionSpec(f.name, options, "+", typing.get_args(base)[0], default))
        else:
            specs.append(OptionSpec(f.name, options, None, base, default))
    return specs


def light_parser() -> argparse.ArgumentParser:
    """An argparse parser of ``foak train``'s options as HF's parser has them (FoakArguments, then the
    installed TrainingArguments' fields with foak's defaults), built without importing transformers. Errors
    raise ValueError (one line). Without the TrainingArguments' source it knows foak's options only."""
    parser = argparse.ArgumentParser(prog="foak train", add_help=False, allow_abbrev=False)
    parser.error = _usage_error
    helps = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(FoakArguments)}
    for spec in [*_foak_specs(), *(training_argument_specs() or ())]:
        kwargs = {"dest": spec.name, "default": spec.default, "type": spec.type, "help": helps.get(spec.name, "")}
        if spec.nargs is not None:
            kwargs.update(nargs=spec.nargs, const=spec.const)
        if spec.choices is not None:
            kwargs.update(choices=spec.choices)
        parser.add_argument(*spec.options, **kwargs)
        if spec.negation:
            parser.add_argument(*spec.negation, dest=spec.name, action="store_false", default=False)
    parser.set_defaults(**TRAINER_DEFAULTS)
    return parser


def parse_light(argv: list[str]) -> argparse.Namespace:
    """``foak train``'s command line parsed without transformers: an unknown option (with the closest names), a
    value of the wrong type or a missing value is a ValueError. HF's parser parses it again when the run
    builds its TrainingArguments."""
    parser = light_parser()
    known = training_argument_specs() is not None
    namespace, remaining = parser.parse_known_args(list(argv))
    if remaining and known:
        raise _unknown_arguments_error(parser, remaining)
    return namespace


def _unknown_arguments_error(parser, remaining: list[str]) -> ValueError:
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    first = next((r for r in remaining if r.startswith("-")), remaining[0])
    close = difflib.get_close_matches(first.split("=")[0], options, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return ValueError(f"unrecognized argument(s): {' '.join(remaining)}{hint} (foak train --help lists the "
                      "options)")


def foak_arguments(namespace: argparse.Namespace, argv: list[str]) -> FoakArguments:
    """The FoakArguments of a parsed command line, checked: ValueError for a value foak cannot take."""
    foak_args = FoakArguments(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(FoakArguments)})
    if foak_args.peft not in PEFT_CHOICES:
        raise ValueError(f"--peft must be none, lora or qlora-nf4, got {foak_args.peft!r}")
    if foak_args.torch_dtype is not None and foak_args.torch_dtype not in DTYPE_CHOICES:
        raise ValueError(f"--torch_dtype must be one of {', '.join(DTYPE_CHOICES)}, got {foak_args.torch_dtype!r}")
    if foak_args.max_seq_length is not None and foak_args.max_seq_length <= 0:
        raise ValueError(f"--max_seq_length must be a positive number of tokens, got {foak_args.max_seq_length}")
    if foak_args.arch is not None:
        if foak_args.model is not None:
            raise ValueError("--arch picks the embedded tiny model's architecture; with --model the model's own "
                             "config decides it: drop --arch")
        from foak.models.tiny import TINY_CONFIGS

        if foak_args.arch not in TINY_CONFIGS:
            raise ValueError(f"--arch {foak_args.arch!r}: no embedded tiny model of that type; choose one of "
                             f"{', '.join(sorted(TINY_CONFIGS))}")
    if foak_args.acceleration_config is not None and foak_args.acceleration_config.lower() == "none":
        foak_args.acceleration_config = "none"
    if foak_args.long_context and foak_args.acceleration_config == "none":
        raise ValueError("--long_context adds foak's offload_activations and tiled_mlp, which --acceleration_config "
                         "none turns off: drop one of them (a baseline with checkpointing: --acceleration_config none "
                         "--gradient_checkpointing)")
    if foak_args.long_context and foak_args.acceleration_config is not None:
        raise ValueError("--long_context adds its switches to foak's default kernels; with --acceleration_config "
                         f"put them in the YAML instead ({', '.join(long_context_switches())}: true) and drop "
                         "--long_context")
    if foak_args.long_context and _given_checkpointing(argv) is False:
        raise ValueError("--long_context needs gradient checkpointing (its offloading keeps the checkpointed layers' "
                         f"inputs): drop {_checkpointing_given_as(argv)}")
    return foak_args


def _checkpointing_given_as(argv: list[str]) -> str:
    """The last --gradient_checkpointing / --activation_checkpointing option of ``argv`` as written (with its
    value), for an error naming what the user passed."""
    flags = {f"--{a}{sep}checkpointing" for a in ("gradient", "activation") for sep in "_-"}
    for i in range(len(argv) - 1, -1, -1):
        if argv[i].split("=", 1)[0] in flags:
            value = argv[i + 1] if "=" not in argv[i] and i + 1 < len(argv) and not argv[i + 1].startswith("-") else ""
            return f"{argv[i]} {value}".strip()
    return "--gradient_checkpointing false"


def parse_foak_arguments(argv: list[str]) -> FoakArguments:
    """The checked FoakArguments of a ``foak train`` command line (every option and value checked as far as
    foak can without transformers, see :func:`parse_light`); ValueError for a bad one."""
    return foak_arguments(parse_light(argv), argv)


def _given_checkpointing(argv: list[str]) -> bool | None:
    """--gradient_checkpointing / --activation_checkpointing (transformers' new name for it) as the command line
    gives it (either spelling, with or without a value), None when neither is given. The parsed
    TrainingArguments cannot tell: their __post_init__ turns "not given" into False."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.error = _usage_error
    for name in ("gradient_checkpointing", "activation_checkpointing"):
        pre.add_argument(f"--{name}", f"--{name.replace('_', '-')}", type=string_to_bool, nargs="?", const=True)
    known, _ = pre.parse_known_args(argv)
    return known.activation_checkpointing if known.activation_checkpointing is not None else \
        known.gradient_checkpointing

def gptq_checkpoint(foak_args, model_config: dict | None) -> dict | None:
    """The ``quantization_config`` of a ``--model`` whose config.json says ``quant_method: gptq`` (None for any
    other model). A GPTQ base is frozen 4-bit: only ``--peft lora`` can train it (ValueError otherwise)."""
    if foak_args.model is None or not isinstance(model_config, dict):
        return None
    qc = model_config.get("quantization_config")
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

def long_context_switches() -> list[str]:
    """The switches --long_context adds that this foak has."""
    from foak.config import AccelerationConfig

    return [s for s in LONG_CONTEXT_SWITCHES if s in AccelerationConfig.model_fields]

def resolve_config(foak_args):
    """What to patch with: None (no foak: ``--acceleration_config none``), "default" (every switch foak has
    for the model, :func:`foak.api.default_config`, chosen once the model is built) or the YAML's
    AccelerationConfig, whose stanza must match --peft."""
    from foak.config import FULL_STANZA, PEFT_STANZA, load_config

    given = foak_args.acceleration_config
    if given == "none":
        return None
    if given is None:
        return "default"
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


def check_architecture(model_type: str | None, foak_args) -> None:
    """foak's kernels need an architecture foak has rules for: otherwise say how to train without them."""
    from foak.models import ARCHITECTURES, served_model_type

    if served_model_type(model_type) not in ARCHITECTURES:
        raise ValueError(
            f"--model {foak_args.model}: foak has no kernels for model_type {model_type!r} (supported: "
            f"{', '.join(sorted(ARCHITECTURES))}); pass --acceleration_config none to train it without foak's "
            "kernels (the baseline)"
        )

# ---- --help ---------------------------------------------------------------------------------------------
# the TrainingArguments `foak train --help` shows, with foak's words; --help_all prints HF's help of all of them
COMMON_TRAINING_ARGUMENTS = {
    "output_dir": "where the model (or the adapter), the tokenizer, loss_curve.png and train_summary.json go",
    "max_steps": "optimizer steps to train (-1: num_train_epochs decides)",
    "num_train_epochs": "epochs over the dataset when max_steps is -1",
    "per_device_train_batch_size": "sequences per micro-batch",
    "gradient_accumulation_steps": "micro-batches per optimizer step",
    "learning_rate": "peak learning rate",
    "lr_scheduler_type": "linear, cosine, constant, ...",
    "warmup_steps": "steps of linear warm-up",
    "weight_decay": "AdamW weight decay",
    "max_grad_norm": "gradient clipping norm",
    "optim": "optimizer: adamw_torch_fused, adamw_torch, sgd, ...",
    "bf16": "bf16 autocast over the weights (fp32 unless --torch_dtype)",
    "fp16": "fp16 autocast with a GradScaler over the weights (fp32 unless --torch_dtype)",
    "gradient_checkpointing": "recompute the layers' activations in the backward (less memory); default off, "
                              "on with --peft qlora-nf4 (--gradient_checkpointing false turns it off)",
    "seed": "seeds python, numpy and torch before the model and adapters are built",
    "logging_steps": "log the mean loss every N steps",
    "log_level": "debug, info, warning, error: foak's logging and transformers' (passive: foak info)",
    "save_strategy": "no, steps or epoch: checkpoints during training (the final model is always saved)",
    "save_steps": "checkpoint every N steps with --save_strategy steps",
    "resume_from_checkpoint": "a checkpoint directory of an earlier run to continue",
    "report_to": "none, tensorboard, wandb, ...",
    "dataloader_num_workers": "data loading processes",
}


def _option_line(action, help_text: str, default_text: str) -> list[str]:
    name = action.option_strings[0]
    takes_value = action.nargs != 0 and not (action.nargs == "?" and action.const is True)
    metavar = "" if not takes_value else " " + ("X [X ...]" if action.nargs in ("+", "*") else "X")
    left = f"  {name}{metavar}"
    text = help_text + (" [" + default_text.replace(" ", "\0") + "]" if default_text else "")  # kept on one line
    width = 30
    body = [line.replace("\0", " ") for line in textwrap.wrap(text, 110 - width - 1)] or [""]
    first = left.ljust(width) + " " + body[0] if len(left) < width else left + "\n" + " " * (width + 1) + body[0]
    return [first] + [" " * (width + 1) + line for line in body[1:]]


def _default_text(dest: str, default) -> str:
    if dest in EMBEDDED_DEFAULTS:
        base = "-1" if dest == "max_steps" else default
        return f"default {base}; the embedded default run: {EMBEDDED_DEFAULTS[dest]}"
    if dest in ("dataloader_pin_memory", "use_cpu") or default is None or default == [] or default is False:
        return ""
    if isinstance(default, list):
        default = " ".join(map(str, default))
    return f"default {default}"


def help_text(full: bool = False) -> str:
    """``foak train --help`` (short: foak's options and the common TrainingArguments, with foak's defaults)
    or, with ``full``, argparse's help of every argument (HF's long tail) with foak's defaults."""
    if full or training_argument_specs() is None:  # HF's own parser (imports transformers)
        from foak.train import build_parser

        parser = build_parser(embedded=False)
        if full:
            return parser.format_help()
    else:
        parser = light_parser()
    foak_dests = set(FoakArguments.__dataclass_fields__)
    by_dest = {a.dest: a for a in parser._actions}
    lines = ["usage: foak train [--model DIR|ORG/NAME] [--dataset FILE.jsonl] [--peft none|lora|qlora-nf4] "
             "[option ...]", "", *textwrap.wrap(DESCRIPTION, 110), "", EXAMPLES, "", "foak options:"]
    for dest in FoakArguments.__dataclass_fields__:
        action = by_dest[dest]
        lines += _option_line(action, action.help or "", _default_text(dest, action.default))
    lines += ["", "common TrainingArguments (all of HF's work; foak train --help_all lists every one):"]
    for dest, text in COMMON_TRAINING_ARGUMENTS.items():
        action = by_dest[dest]
        assert dest not in foak_dests
        lines += _option_line(action, text, _default_text(dest, action.default))
    lines += ["", *textwrap.wrap(
        "Every option takes underscores or dashes (--max_steps = --max-steps). Errors are one line on stderr "
        "and exit code 2; --debug (or FOAK_DEBUG=1) adds the traceback.", 110)]
    return "\n".join(lines) + "\n"


# ---- logging --------------------------------------------------------------------------------------------
class _StdoutHandler(logging.Handler):
    """Writes to the sys.stdout of the moment (so a redirected or captured stdout receives it)."""

    def emit(self, record):
        try:
            prefix = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
            sys.stdout.write(prefix + record.getMessage() + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 (logging must never raise)
            self.handleError(record)


LOG_LEVELS = {"passive": logging.INFO, "detail": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO,
              "warning": logging.WARNING, "error": logging.ERROR, "critical": logging.CRITICAL}


def setup_logging(log_level: str = "passive") -> None:
    """foak's loggers (``foak.*``) to stdout at ``log_level`` (TrainingArguments' names; passive = info)."""
    logger = logging.getLogger("foak")
    for handler in [h for h in logger.handlers if isinstance(h, _StdoutHandler)]:
        logger.removeHandler(handler)
    logger.addHandler(_StdoutHandler())
    level = LOG_LEVELS.get(log_level, logging.INFO)
    if "torch" in sys.modules:
        from foak.integrations.accelerate import is_main_process

        main = is_main_process()
    else:  # (no process group without torch: the launcher's RANK, as foak.integrations.accelerate.rank reads it)
        main = int(os.environ.get("RANK", "0")) == 0
    if not main:  # under torchrun / accelerate launch: the report and summary from rank 0 only
        level = max(level, logging.WARNING)
    logger.setLevel(level)
    logger.propagate = False


@dataclass
class CheckedRun:
    """What :func:`check_arguments` established about a ``foak train`` command line."""

    foak_args: FoakArguments
    log_level: str
    source: typing.Any  # foak.model_source.ModelSource of --model (None: the embedded tiny model)
    gptq: dict | None  # the quantization_config of a GPTQ --model
    config: typing.Any  # None (no foak), "default" or the YAML's AccelerationConfig


def offloads(checked: CheckedRun) -> bool:
    """Whether the run of ``checked`` switches offload_activations on (--long_context or the YAML)."""
    if checked.config is None:
        return False
    if checked.config == "default":
        return checked.foak_args.long_context
    return bool(getattr(checked.config, "offload_activations", False))


def pinned_host_allocation(checked: CheckedRun, environ=None) -> str | None:
    """For a run that offloads: adds foak.alloc_conf's PINNED_HOST_SETTINGS to torch's allocator settings in
    ``environ`` (default ``os.environ``); a setting the user gave is kept. Returns the line to log (None: nothing
    to say). Call it before torch is imported: torch reads the variable once."""
    if not offloads(checked):
        return None
    from foak.alloc_conf import PINNED_HOST_SETTINGS, as_dict, settings

    environ = os.environ if environ is None else environ
    name, given = settings(environ)
    added = [f"{k}:{v}" for k, v in PINNED_HOST_SETTINGS.items() if k not in as_dict(given)]
    if not added:
        return None
    if "torch" in sys.modules:  # too late to be sure torch reads it: say what to set instead
        return (f"offload_activations pins host memory faster with {name}={','.join(given + added)} set before "
                "torch is imported")
    environ[name] = ",".join(given + added)
    return (f"offload_activations: on CUDA, torch pins the host copies by cudaHostRegister on "
            f"{PINNED_HOST_SETTINGS['pinned_num_register_threads']} threads ({name}={environ[name]})")


def check_arguments(argv: list[str]) -> CheckedRun:
    """Everything a user can get wrong on a ``foak train`` command line that foak can check without torch or
    transformers, in this order: the options and their values, ``--model`` (a local model directory or a hub
    id, :func:`foak.model_source.resolve_model`), a GPTQ --model's --peft, the ``--acceleration_config`` YAML
    and its stanza, the model's architecture, the ``--dataset`` path. Sets up foak's logging (``--log_level``).
    ValueError for the first problem."""
    namespace = parse_light(argv)
    foak_args = foak_arguments(namespace, argv)
    log_level = getattr(namespace, "log_level", "passive")
    setup_logging(log_level)
    source = None
    if foak_args.model is not None:
        from foak.model_source import resolve_model

        source = resolve_model(foak_args.model)
    gptq = gptq_checkpoint(foak_args, None if source is None else source.config)  # a GPTQ --model needs lora
    config = resolve_config(foak_args)
    if config is not None:
        check_architecture((foak_args.arch or "llama") if source is None else source.model_type, foak_args)
    if foak_args.dataset is not None and not Path(foak_args.dataset).is_file():
        from foak.data import DatasetError  # (imports torch: only on this error path)

        raise DatasetError(f"dataset file not found: {foak_args.dataset}")  # (read_jsonl's words)
    return CheckedRun(foak_args, log_level, source, gptq, config)
