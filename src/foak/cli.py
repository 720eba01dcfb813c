"""The ``foak`` command line: ``foak info`` and ``foak verify`` (training and benchmarks come later)."""

from __future__ import annotations

import argparse
import platform
import sys

import torch


def _cmd_info(args) -> int:
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
    from foak.backend import describe

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = describe(device)
    if backend == "reference":
        print("note: no GPU and no TRITON_INTERPRET=1, so the reference ops are compared with themselves; "
              "set TRITON_INTERPRET=1 to check the Triton kernels on CPU")
    if args.ops:
        return _verify_ops(device, backend)
    return _verify_model(args, device, backend)


def _verify_ops(device, backend) -> int:
    from foak.testing import run_self_check

    print(f"foak verify --ops on {device} (backend: {backend}); every op forward and backward vs its "
          "torch reference (relative error vs fp32)")
    rows = run_self_check(device)
    print(_format_table(rows))
    failed = sum(not r["passed"] for r in rows)
    print(f"self-check: {len(rows) - failed} of {len(rows)} cases within tolerance")
    return 1 if failed else 0


def _verify_model(args, device, backend) -> int:
    from foak.models.tiny import tiny_model
    from foak.verify import compared_note, format_rows, verify_model

    if args.model:
        import transformers

        from foak.verify import gptq_quantization

        dtype = getattr(torch, args.dtype)
        qc = gptq_quantization(args.model)
        if qc is not None:  # foak's loader (transformers' GPTQ path would need gptqmodel)
            from foak.quant import load_gptq

            model = load_gptq(args.model, dtype=dtype, device=device)
            source = (f"{args.model} (GPTQ 4-bit checkpoint, group_size {qc.get('group_size', 128)}, loaded by "
                      "foak.quant.load_gptq)")
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
            source = args.model
    else:
        model = tiny_model(args.arch).to(device=device, dtype=getattr(torch, args.dtype))
        source = f"tiny {args.arch} (2 layers, hidden 64, random weights)"
    print(f"foak verify: {source} on {device} ({args.dtype}, backend: {backend}); unpatched vs patched, "
          "loss and every parameter gradient after one forward+backward")
    note = compared_note(model)
    if note:
        print(note)
    rows = verify_model(model, args.rules)
    print(format_rows(rows))
    if args.dtype == "float32":
        print("* vs the unpatched model")
    else:
        print(f"* the gradient error foak adds beyond the unpatched {args.dtype} model's own (all gradients as "
              "one vector, both against an fp32 copy)")
    failed = [r.name for r in rows if not r.passed]
    print(f"verify: {len(rows) - len(failed)} of {len(rows)} rule checks within tolerance")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foak", description="Fused Operations And Kernels for LLM fine-tuning")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, GPU and which backend the ops use")
    info.set_defaults(func=_cmd_info)
    verify = sub.add_parser("verify", help="check numerics against the torch references")
    verify.add_argument("--ops", action="store_true", help="run every kernel against its reference")
    verify.add_argument("--model", help="local path of an HF causal LM or a GPTQ 4-bit checkpoint "
                                            "(default: a tiny random model)")
    verify.add_argument("--arch", default="llama", help="architecture of the tiny default model")
    verify.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    verify.add_argument("--rules", nargs="*", help="rule switches to check (default: all of the model's)")
    verify.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    verify.set_defaults(func=_cmd_verify)
    sub.add_parser("train", help="fine-tune a causal LM (foak train --help lists the arguments)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # HF TrainingArguments names: parsed by transformers' HfArgumentParser
        from foak.train import train

        train(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
