"""The ``foak`` command line: ``foak info``, ``foak verify``, ``foak train`` (foak.train), ``foak bench``
(foak.bench.cli) and ``foak --version`` (the installed package's metadata).

A user error (a bad path, dataset, config or argument, an unsupported model) is one line on stderr, prefixed
``foak <command>: error:``, and exit code 2; ``--debug`` anywhere on the command line (or ``FOAK_DEBUG=1``)
prints the traceback too. The arguments are parsed and checked before torch or transformers is imported
(``foak --help``, ``foak train --help`` and argument errors come back at once; foak.train_cli for foak train).
bitsandbytes' warning that its optional CPU 4-bit GEMM kernel (from the ``kernels`` package) could not be
loaded is silenced; nothing else is."""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import traceback

# what a user can get wrong: printed as one line (the traceback with --debug)
USER_ERRORS = (ValueError, OSError, ImportError)
# TrainingArguments' own --debug takes one of these; a bare --debug is foak's
HF_DEBUG_VALUES = ("underflow_overflow", "tpu_metrics_debug")
BNB_CPU_WARNING = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _BnbCpuWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(BNB_CPU_WARNING)


def silence_bitsandbytes_cpu_warning() -> None:
    """Drop bitsandbytes' start-up warning on CPUs with AVX512-BF16 that its optional CPU kernel from the
    ``kernels`` package is not installed (transformers' Trainer imports bitsandbytes, so every run printed it).
    Only that message, only from the logger that emits it."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _BnbCpuWarningFilter) for f in logger.filters):
        logger.addFilter(_BnbCpuWarningFilter())


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line via main's handler, not the usage text
        raise ValueError(message)


def _cmd_info(args) -> int:
    import torch
    import triton

    import foak
    from foak.backend import describe, get_backend, interpreter_enabled

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"foak        {foak.__version__}")
    print(f"python      {platform.python_version()}")
    print(f"torch       {torch.__version__}")
    print(f"triton      {triton.__version__}")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"gpu         {gpu}")
    print(f"interpreter {'on (TRITON_INTERPRET=1)' if interpreter_enabled() else 'off'}")
    print(f"backend     {get_backend()} -> ops on {device} run on: {describe(device)}")
    if describe(device) == "reference":
        print("            (Triton kernels need a CUDA GPU, or TRITON_INTERPRET=1 to run them slowly on CPU)")
    from foak.models import ARCHITECTURES

    print(f"models      {len(ARCHITECTURES)} model types: {', '.join(sorted(ARCHITECTURES))}")
    return 0


def _format_table(rows: list[dict]) -> str:
    header = ("op", "case", "dtype", "worst output/grad", "rel. error", "tolerance", "result")
    body = [
        (r["op"], r["case"], r["dtype"], r["worst"], f"{r['error']:.2e}", f"{r['tolerance']:.0e}",
         "PASS" if r["passed"] else "FAIL")
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in [header, *body]) for i in range(len(header))]

    def fmt(line):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(header), sep, *map(fmt, body)])


def _cmd_verify(args) -> int:
    import torch

    from foak.backend import describe, get_backend

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA GPU is available here")
    backend = describe(device)
    if backend == "reference":
        if get_backend() == "auto":
            raise ValueError(
                "no CUDA GPU and TRITON_INTERPRET is not 1, so foak's Triton kernels cannot run here and foak "
                "verify would only compare foak's torch references (with themselves for --ops): run "
                "TRITON_INTERPRET=1 foak verify (the kernels in Triton's CPU interpreter: exact, slow), or on a GPU")
        if args.ops:
            raise ValueError("the backend is forced to 'reference' (FOAK_BACKEND or foak.set_backend), so --ops "
                             "would compare the reference ops with themselves; unset it")
        print("note: the backend is forced to 'reference': foak's rules with its torch reference ops are "
              "compared with the unpatched model, not the Triton kernels")
    if args.ops:
        return _verify_ops(device, backend)
    return _verify_model(args, device, backend)


def _verify_ops(device, backend) -> int:
    from foak.testing import OPS_NOT_SELF_CHECKED, run_self_check

    print(f"foak verify --ops on {device} (backend: {backend}); each op below forward and backward vs its "
          "torch reference (relative error vs fp32)")
    rows = run_self_check(device)
    if not rows:
        raise ValueError("the self-check compared nothing")
    print(_format_table(rows))
    by_rule: dict[str, list[str]] = {}
    for op, rule in OPS_NOT_SELF_CHECKED.items():
        by_rule.setdefault(rule, []).append(op)
    print("not run by --ops (foak verify without --ops checks them in the model rows of): " + "; ".join(
        f"{', '.join(ops)} ({rule})" for rule, ops in by_rule.items()))
    failed = sum(not r["passed"] for r in rows)
    print(f"self-check: {len(rows) - failed} of {len(rows)} cases within tolerance")
    return 1 if failed else 0


def _load_verify_model(args, device, dtype):
    """(model, description) of --model: a local directory or a hub id (foak.model_source), a GPTQ 4-bit
    checkpoint through foak.quant.load_gptq."""
    from foak.model_source import resolve_model
    from foak.models import ARCHITECTURES, served_model_type

    source = resolve_model(args.model, need_tokenizer=False)  # before transformers is imported: fails fast
    if served_model_type(source.model_type) not in ARCHITECTURES:
        raise ValueError(f"--model {args.model}: foak has no rules for model_type {source.model_type!r} "
                         f"(supported: {', '.join(sorted(ARCHITECTURES))}), so there is nothing to verify")
    from foak.verify import gptq_quantization

    qc = gptq_quantization(source.config)
    if qc is not None:
        # foak's loader (transformers' GPTQ path would need gptqmodel)
        from foak.quant import load_gptq

        model = load_gptq(source.local_dir(), dtype=dtype, device=device)
        return model, (f"{source} (GPTQ 4-bit checkpoint, group_size {qc.get('group_size', 128)}, loaded by "
                       "foak.quant.load_gptq)")
    import transformers

    hub = {"local_files_only": True} if source.local_files_only else {}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(source.ref, dtype=dtype, **hub)
    except (OSError, ValueError, ImportError, KeyError) as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ValueError(f"--model {args.model}: transformers could not load it: {first}") from e
    return model.to(device), str(source)


def _verify_model(args, device, backend) -> int:
    import torch

    dtype = getattr(torch, args.dtype)
    if args.model:
        model, source = _load_verify_model(args, device, dtype)
    else:
        from foak.models.tiny import tiny_model

        model = tiny_model(args.arch).to(device=device, dtype=dtype)
        source = f"tiny {args.arch} (2 layers, hidden 64, random weights)"
    from foak.verify import compared_note, format_report, verify_model

    print(f"foak verify: {source} on {device} ({args.dtype}, backend: {backend}); unpatched vs patched copies, "
          "one forward+backward, the loss and every parameter's gradient; each rule alone, then together")
    note = compared_note(model)
    if note:
        print(note)
    report = verify_model(model, args.rules)
    print(format_report(report))
    return 0 if report.passed else 1


def build_parser() -> argparse.ArgumentParser:
    import foak

    parser = _Parser(prog="foak", description="Fused Operations And Kernels for LLM fine-tuning")
    parser.add_argument("--version", action="version", version=f"foak {foak.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, GPU and which backend the ops use")
    info.set_defaults(func=_cmd_info)
    verify = sub.add_parser(
        "verify", help="check numerics against the torch references",
        description="Patched vs unpatched model (or, with --ops, every op vs its torch reference), forward and "
                    "backward, the loss and each parameter's gradient: every rule of the model alone and "
                    "together (fused_lora on a LoRA copy, packed attention on a packed batch); rules it could "
                    "not check are named. Needs a CUDA GPU or TRITON_INTERPRET=1 (the kernels in Triton's CPU "
                    "interpreter); without either it is an error, since only the references would be compared. "
                    "Exit code 0: every check passed, 1: a check failed, 2: a usage error (nothing was compared).")
    verify.add_argument("--ops", action="store_true", help="run the ops' self-check cases against their "
                                                            "references (the output names the ops it has none for)")
    verify.add_argument("--model", help="local directory or hub id of an HF causal LM, or a GPTQ 4-bit "
                                        "checkpoint directory (default: a tiny random model)")
    verify.add_argument("--arch", default="llama", help="architecture of the tiny default model")
    verify.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    verify.add_argument("--rules", nargs="+", help="rule switches to check, e.g. rms_norm moe lora packed_attention "
                                                   "(or their config keys: fast_moe ...; default: every one foak "
                                                   "has for the model)")
    verify.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    verify.set_defaults(func=_cmd_verify)
    sub.add_parser("train", help="fine-tune a causal LM (foak train --help lists the arguments)", add_help=False)
    sub.add_parser("bench", help="benchmark scenarios and regression checks (foak bench --help)", add_help=False)
    return parser


def _pop_debug(argv: list[str]) -> tuple[bool, list[str]]:
    """foak's bare --debug, removed from argv (TrainingArguments' ``--debug underflow_overflow`` stays)."""
    debug, rest = False, []
    for i, arg in enumerate(argv):
        if arg == "--debug" and (i + 1 == len(argv) or argv[i + 1] not in HF_DEBUG_VALUES):
            debug = True
        else:
            rest.append(arg)
    return debug, rest


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    text = lines[0]
    for line in lines[1:]:
        text += (" " if text.endswith(":") else "; ") + line
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug, argv = _pop_debug(argv)
    debug = debug or os.environ.get("FOAK_DEBUG", "0") not in ("", "0")
    silence_bitsandbytes_cpu_warning()
    command = argv[0] if argv and argv[0] in ("info", "verify", "train", "bench") else None
    try:
        if command == "bench":  # foak.bench.cli parses its own arguments (scenario runs and compare)
            from foak.bench.cli import main as bench_main

            return bench_main(argv[1:])
        if command == "train":  # foak's options and HF TrainingArguments names
            from foak.train_cli import check_arguments, help_text

            rest = argv[1:]
            if any(a in ("--help_all", "--help-all") for a in rest):
                print(help_text(full=True), end="")
                return 0
            if any(a in ("-h", "--help") for a in rest):
                print(help_text(), end="")
                return 0
            checked = check_arguments(rest)  # the user's errors, before torch and transformers are imported
            from foak.train_cli import pinned_host_allocation

            note = pinned_host_allocation(checked)  # torch's allocator settings: before torch is imported
            if note:
                logging.getLogger("foak").info(note)
            from foak.train import train

            train(rest, checked)
            return 0
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help, --version
            return e.code if isinstance(e.code, int) else 0
        return args.func(args)
    except USER_ERRORS as e:
        if debug:
            traceback.print_exc()
        prefix = f"foak {command}" if command else "foak"
        print(f"{prefix}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
