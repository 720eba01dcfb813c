"""`axolotl train` with foak's plugin against axolotl's own LoRA kernels + Liger, on the GPU.

A Llama with Llama-3-8B dimensions (hidden 4096, intermediate 14336, 32 heads / 8 KV heads, vocab 128256; 8 layers
by default), randomly initialised and saved locally in bf16, a character tokenizer and generated text (no
downloads). LoRA r=16 on every linear, bf16, sdpa attention, gradient checkpointing, AdamW; sample packing into
rows of --seq tokens (--no-packing: one text per row). Each variant runs `axolotl train CONFIG --launcher python`
(with --fsdp: `torchrun --nproc_per_node 1 -m axolotl.cli.train CONFIG`, FSDP2) in a process of its own:

    peft           axolotl's LoRA on plain PEFT (lora_*_kernel: false, no Liger): the reference
    axolotl_liger  axolotl's own fused LoRA kernels (lora_mlp/qkv/o_kernel: true) + the Liger plugin (liger_rms_norm,
                   liger_rope, liger_glu_activation, liger_fused_linear_cross_entropy)
    foak           plugins: [foak.integrations.axolotl.FoakPlugin] (foak.patch's defaults)

A small probe plugin (written next to the configs) records each optimizer step's wall time (CUDA-synchronised),
the logged losses and token counts, the peak allocated memory since the training began, and foak's patch report.
Checks: every variant's step-1 loss equals peft's within 2e-2 (bf16; LoRA's B starts at zero, so step 1 is the
base model's loss), its losses are finite, and foak's run patched the attention/MLP/loss rules and turned
axolotl's LoRA kernels off. Throughput: tokens (axolotl's tokens/total) over the timed steps' summed time.
JSON under --out; the table last.

    python3 benchmarks/axolotl.py --out $OUT                        # H200: Llama-8B dims, 8 layers
    python3 benchmarks/axolotl.py --out $OUT --fsdp                 # the same under axolotl's FSDP2 path
    python3 benchmarks/axolotl.py --tiny --out /tmp/x               # CPU smoke: tiny Llama, peft vs foak
    python3 benchmarks/axolotl.py --print-wheels                    # what the GPU machine needs carried

The GPU image has torch 2.11 / transformers 5.17 / peft / accelerate 1.15 and no axolotl: carry the wheels that
--print-wheels lists (about 43 MB: axolotl 0.21.0, transformers 5.20.1, trl 1.14.1, datasets 5.0.1, liger-kernel
0.8.4, wandb 0.31.0, pydantic 2.13.5, ...) in .wheels, install them with --target and put that first on PYTHONPATH
(docs/axolotl.md). axolotl imports bitsandbytes even for LoRA: install the base set's wheel
(`benchmarks/wheels.py base`) into the same folder too, in a call of its own (the two sets exceed one call's
64 MiB carry).
"""

from __future__ import annotations

import sys
from pathlib import Path

# this file is named axolotl.py: its folder must not shadow the axolotl package for anything imported below
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

PLUGIN = "foak.integrations.axolotl.FoakPlugin"
LIGER = "axolotl.integrations.liger.LigerPlugin"
PROBE = "foak_axolotl_probe.ProbePlugin"
VARIANTS = ("peft", "axolotl_liger", "foak")

# what the GPU image lacks for this benchmark (cp312, manylinux); its own torch/accelerate/peft/hub/numpy... stay
DEVICE_WHEELS = (
    "axolotl==0.21.0", "axolotl-contribs-lgpl==0.0.7", "axolotl-contribs-mit==0.0.6", "transformers==5.20.1",
    "trl==1.14.1", "datasets==5.0.1", "dill==0.4.1", "multiprocess==0.70.19", "evaluate==0.4.1", "liger_kernel==0.8.4",
    "kernels==0.17.2", "fastcore==2.2.41", "addict==2.4.0", "fire==0.7.1", "termcolor==3.3.0", "posthog==6.7.11",
    "backoff==2.2.1", "distro==1.9.0", "wandb==0.31.0", "cwevals==0.0.1b1", "opentelemetry-api==1.45.2",
    "opentelemetry-exporter-http-transport==0.66b2", "opentelemetry-exporter-otlp-common==0.66b2",
    "opentelemetry-exporter-otlp-proto-common==1.45.2", "opentelemetry-exporter-otlp-proto-http==1.45.2",
    "opentelemetry-proto==1.45.2", "opentelemetry-sdk==1.45.2", "opentelemetry-semantic-conventions==0.66b2",
    "googleapis-common-protos==1.76.0", "pydantic==2.13.5", "pydantic_core==2.46.5", "typing-inspection==0.4.5",
    "annotated-types==0.8.0", "platformdirs==4.14.9", "python-dotenv==1.0.1", "sniffio==1.3.1",
)

PROBE_SOURCE = '''"""Written by foak's benchmarks/axolotl.py: records step times, losses, tokens and peak memory."""
import json, os, time
import torch
from transformers import TrainerCallback
from axolotl.integrations.base import BasePlugin, PluginManager


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


_PEAK = [0]


def _fold_peak():
    if torch.cuda.is_available():
        _PEAK[0] = max(_PEAK[0], torch.cuda.max_memory_allocated())


# something in the trainer resets CUDA's peak statistics during training (the first H200 run read only the weights
# at on_train_end): fold the peak in before every reset, and at every step's end
_reset = torch.cuda.reset_peak_memory_stats


def _folding_reset(*args, **kwargs):
    _fold_peak()
    return _reset(*args, **kwargs)


torch.cuda.reset_peak_memory_stats = _folding_reset


def _peak_gib():
    if not torch.cuda.is_available():
        return None
    _fold_peak()
    return _PEAK[0] / 2**30


class _Probe(TrainerCallback):
    def __init__(self, cfg):
        self.cfg, self.steps, self.logs, self.t0 = cfg, [], [], None

    def on_train_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            _reset()
            _PEAK[0] = 0

    def on_step_begin(self, args, state, control, **kwargs):
        _sync()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        self.steps.append(time.perf_counter() - self.t0)
        _fold_peak()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({k: v for k, v in (logs or {}).items() if isinstance(v, (int, float, str))})

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        model = kwargs.get("model")
        try:
            from torch.distributed.fsdp import FSDPModule
            fsdp_units = sum(isinstance(m, FSDPModule) for m in model.modules()) if model is not None else None
        except ImportError:
            fsdp_units = None
        foak = PluginManager.get_instance().plugins.get("foak.integrations.axolotl.FoakPlugin")
        report = getattr(foak, "report", None)
        out = {
            "step_seconds": self.steps, "logs": self.logs,
            "fsdp_units": fsdp_units,
            "peak_allocated_gib": _peak_gib(),
            "cfg": {k: (v if isinstance(v, (bool, int, float, str, type(None))) else str(v))
                    for k, v in self.cfg.items() if k.startswith(("lora_", "liger_", "sample_packing", "fsdp"))},
            "foak_report": str(report) if report is not None else None,
            "foak_rows": {r.rule_id: [r.modules, r.notes] for r in report.results} if report is not None else None,
        }
        with open(os.environ["FOAK_PROBE_OUT"], "w") as f:
            json.dump(out, f, indent=1, default=str)


class ProbePlugin(BasePlugin):
    def add_callbacks_post_trainer(self, cfg, trainer):
        return [_Probe(cfg)]
'''


def model_dims(tiny: bool, layers: int) -> dict:
    if tiny:
        return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024)
    return dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)


def prepare(work: Path, tiny: bool, layers: int, seq: int, rows: int) -> None:
    """The random-init model (bf16 on the GPU, fp32 for --tiny) with a character tokenizer, and the corpus."""
    import torch
    import transformers

    from foak.data import char_tokenizer

    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        tok = char_tokenizer()
        config = transformers.LlamaConfig(**model_dims(tiny, layers), pad_token_id=tok.pad_token_id,
                                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                          tie_word_embeddings=False)
        torch.manual_seed(0)
        device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).to(torch.float32 if tiny else torch.bfloat16)
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        del model
    words = ("the cat sat on a mat while our team ran to the old station and a small bird sang near the river "
             "my friend wrote three short letters before noon").split()
    rng = random.Random(0)
    with open(work / "data.jsonl", "w") as f:
        for _ in range(rows):
            n_chars = rng.randint(seq // 4, seq - 8)  # a character per token: packing fills rows of `seq`
            text = ""
            while len(text) < n_chars:
                text += " ".join(rng.choice(words) for _ in range(12)) + ". "
            f.write(json.dumps({"text": text[:n_chars]}) + "\n")


def axolotl_config(work: Path, variant: str, args) -> dict:
    steps = args.warmup + args.steps
    cfg = dict(
        base_model=str(work / "model"), datasets=[dict(path=str(work / "data.jsonl"), type="completion",
                                                       ds_type="json")],
        sequence_len=args.seq, micro_batch_size=args.batch, gradient_accumulation_steps=1, max_steps=steps,
        learning_rate=1e-4, optimizer="adamw_torch", lr_scheduler="constant", warmup_steps=0,
        output_dir=str(work / f"out_{variant}"), dataset_prepared_path=str(work / "prepared"), val_set_size=0,
        save_strategy="no", save_first_step=False, logging_steps=1, seed=0, dataset_num_proc=1,
        attn_implementation="sdpa", sample_packing=args.packing, pad_to_sequence_len=args.packing,
        gradient_checkpointing=not args.tiny, adapter="lora", lora_r=16, lora_alpha=32, lora_dropout=0.0,
        lora_target_linear=True, plugins=[PROBE], special_tokens={})
    if args.tiny:
        cfg.update(bf16=False, fp16=False, tf32=False)
    else:
        cfg.update(bf16=True, tf32=True)
    if args.fsdp:
        cfg.update(fsdp_version=2, fsdp_config=dict(
            reshard_after_forward=True, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
            transformer_layer_cls_to_wrap="LlamaDecoderLayer", state_dict_type="FULL_STATE_DICT"))
    if variant == "peft":
        cfg.update(lora_mlp_kernel=False, lora_qkv_kernel=False, lora_o_kernel=False)
    elif variant == "axolotl_liger":
        cfg.update(lora_mlp_kernel=True, lora_qkv_kernel=True, lora_o_kernel=True, liger_rms_norm=True,
                   liger_rope=True, liger_glu_activation=True, liger_fused_linear_cross_entropy=True)
        cfg["plugins"] = [LIGER, PROBE]
    elif variant == "foak":
        cfg["plugins"] = [PLUGIN, PROBE]
    else:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return cfg


def run_variant(work: Path, variant: str, args) -> dict:
    import yaml

    cfg_path = work / f"{variant}.yml"
    cfg_path.write_text(yaml.safe_dump(axolotl_config(work, variant, args)))
    probe_out = work / f"probe_{variant}.json"
    probe_out.unlink(missing_ok=True)
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = dict(os.environ, FOAK_PROBE_OUT=str(probe_out), AXOLOTL_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(work), src] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    if args.tiny:
        env["FOAK_BACKEND"] = "reference"  # the CPU smoke checks the wiring; kernels have their own tests
    if args.fsdp:  # what `axolotl train --launcher torchrun` runs, with this interpreter's torchrun
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                   "-m", "axolotl.cli.train", str(cfg_path)]
    else:  # `axolotl train CONFIG --launcher python`
        command = [sys.executable, "-m", "axolotl.cli.main", "train", str(cfg_path), "--launcher", "python"]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (work / f"log_{variant}.txt").write_text(proc.stdout + proc.stderr)
    row = {"variant": variant, "returncode": proc.returncode, "wall_seconds": round(wall, 1)}
    if proc.returncode != 0 or not probe_out.is_file():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        row["error"] = "\n".join(tail)
        return row
    probe = json.loads(probe_out.read_text())
    losses = [log["loss"] for log in probe["logs"] if "loss" in log]
    tokens = [log["tokens/total"] for log in probe["logs"] if "tokens/total" in log and "loss" in log]
    timed = probe["step_seconds"][args.warmup:]
    timed_tokens = tokens[-1] - tokens[args.warmup - 1] if args.warmup and len(tokens) > args.warmup else None
    row.update(losses=losses, step_seconds=probe["step_seconds"], peak_allocated_gib=probe["peak_allocated_gib"],
               tokens_per_second=timed_tokens / sum(timed) if timed_tokens and timed else None,
               median_step_seconds=sorted(timed)[len(timed) // 2] if timed else None,
               fsdp_units=probe.get("fsdp_units"), cfg=probe["cfg"], foak_rows=probe["foak_rows"],
               foak_report=probe["foak_report"])
    return row


def check(rows: list[dict], fsdp: bool = False) -> list[str]:
    """The correctness lines; an empty list when everything holds."""
    failures = []
    if fsdp:  # accelerate applies FSDP only on accelerators (its CPU processes run without it)
        failures += [f"{r['variant']}: --fsdp, but the trained model holds no FSDP2 unit ({r.get('fsdp_units')})"
                     for r in rows if "error" not in r and not r.get("fsdp_units")]
    by = {r["variant"]: r for r in rows}
    ref = by.get("peft")
    for r in rows:
        if "error" in r:
            failures.append(f"{r['variant']}: the run failed (rc {r['returncode']})")
            continue
        if not r["losses"] or not all(math.isfinite(v) for v in r["losses"]):
            failures.append(f"{r['variant']}: losses not finite: {r['losses']}")
        if ref is not None and "error" not in ref and r is not ref and ref["losses"] and r["losses"]:
            a, b = r["losses"][0], ref["losses"][0]
            r["step1_loss_rel_to_peft"] = abs(a - b) / abs(b)
            if r["step1_loss_rel_to_peft"] > 2e-2:
                failures.append(f"{r['variant']}: step-1 loss {a:.5f} vs peft's {b:.5f}")
    foak = by.get("foak")
    if foak is not None and "error" not in foak:
        rows_ = foak["foak_rows"] or {}
        for rule in ("llama.rms_norm", "llama.rope", "llama.swiglu", "llama.fused_lora", "llama.fused_linear_loss"):
            if not rows_.get(rule) or rows_[rule][0] <= 0:
                failures.append(f"foak: rule {rule} patched nothing ({rows_.get(rule)})")
        if any(foak["cfg"].get(k) for k in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel")):
            failures.append(f"foak: axolotl's LoRA kernels were on: {foak['cfg']}")
    return failures


def table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["variant"] == "peft" and r.get("tokens_per_second")), None)
    lines = [f"{'variant':<15} {'tokens/s':>10} {'vs peft':>8} {'step s':>8} {'peak GiB':>9} {'step-1 loss':>12}"]
    for r in rows:
        if "error" in r:
            lines_ = r["error"].splitlines() or [""]
            last = next((x for x in reversed(lines_) if "Error" in x), lines_[-1])
            lines.append(f"{r['variant']:<15} failed (rc {r['returncode']}): {last.strip()[:100]}")
            continue
        tps = r.get("tokens_per_second")
        gain = f"{tps / ref['tokens_per_second']:.3f}x" if tps and ref else "-"
        peak = f"{r['peak_allocated_gib']:.1f}" if r["peak_allocated_gib"] is not None else "-"
        lines.append(f"{r['variant']:<15} {tps or 0:>10.0f} {gain:>8} {r['median_step_seconds'] or 0:>8.3f} "
                     f"{peak:>9} {r['losses'][0]:>12.5f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where the JSON goes (default: $OUT or ./axolotl-bench)")
    parser.add_argument("--work", type=Path, help="model, data, configs, logs (default: a folder under /tmp)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke: a tiny Llama, fp32, 128 tokens")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--steps", type=int, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--no-packing", dest="packing", action="store_false")
    parser.add_argument("--fsdp", action="store_true", help="axolotl's FSDP2 path (torchrun, one process)")
    parser.add_argument("--print-wheels", action="store_true", help="print the pip download command and exit")
    args = parser.parse_args()
    if args.print_wheels:
        print("python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
              + " ".join(f"--platform {p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                                     "manylinux_2_17_x86_64", "manylinux2014_x86_64"))
              + " -d .wheels " + " ".join(w for w in DEVICE_WHEELS if not w.startswith("axolotl-contribs")))
        print("python3 -m pip wheel --no-deps -w .wheels axolotl-contribs-lgpl==0.0.7 axolotl-contribs-mit==0.0.6"
              "   # source-only on the index: built here (pure Python)")
        print("# and bitsandbytes (axolotl imports it even for LoRA): the base set's wheel (benchmarks/wheels.py base),"
              " installed into the same --target folder in a call of its own (both sets exceed one call's carry)")
        return 0
    defaults = dict(seq=128, batch=2, steps=2, warmup=1) if args.tiny else dict(seq=4096, batch=2, steps=10, warmup=3)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    variants = args.variants or (("peft", "foak") if args.tiny else VARIANTS)
    out = args.out or Path(os.environ.get("OUT") or "axolotl-bench")
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path("/tmp/foak-axolotl-bench" + ("-tiny" if args.tiny else ""))
    work.mkdir(parents=True, exist_ok=True)
    (work / "foak_axolotl_probe.py").write_text(PROBE_SOURCE)

    from foak.bench.measure import environment

    prepare(work, args.tiny, args.layers, args.seq, rows=64 if args.tiny else 400)
    rows = []
    for variant in variants:
        row = run_variant(work, variant, args)
        rows.append(row)
        print(f"{variant}: rc {row['returncode']}, {row['wall_seconds']} s" + (f"\n{row['error']}" if "error" in row
                                                                           else ""), flush=True)
    failures = check(rows, fsdp=args.fsdp)
    foak_row = next((r for r in rows if r["variant"] == "foak" and r.get("foak_report")), None)
    if foak_row:
        print(foak_row["foak_report"])
    name = ("axolotl_" + ("cpu_tiny" if args.tiny else f"h200_llama8b-{args.layers}l")
            + ("_fsdp2" if args.fsdp else "") + ("" if args.packing else "_unpacked"))
    result = {"benchmark": "benchmarks/axolotl.py", "environment": environment(),
              "setting": {k: getattr(args, k) for k in ("tiny", "layers", "seq", "batch", "steps", "warmup", "packing",
                                                        "fsdp")},
              "variants": rows, "failures": failures}
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {path}")
    print("checks: " + ("all passed" if not failures else "FAILED\n  " + "\n  ".join(failures)))
    print(table(rows))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
