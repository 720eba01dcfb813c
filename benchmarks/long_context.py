"""Long-context memory on one GPU: the peak memory of one LoRA training step (forward + backward) per sequence
length, HF alone vs + Liger vs + foak, each (framework, length) in its own process (an OOM ends only its own
run).

Setup (the long-context issue's): Llama-3.1-8B dims, all 32 layers, vocab 128256, bf16 weights, PEFT LoRA r16 on
every linear layer, HF gradient checkpointing (non-reentrant unless --reentrant), batch 1, random tokens, sdpa.
No autocast by default: PEFT's adapters are fp32 (its default) on the bf16 base, and PEFT (with foak following its
arithmetic) sums their fp32 products into the bf16 outputs, while Unsloth casts its adapters to bf16; ``--autocast``
runs every step under torch.autocast(bf16), as HF's Trainer(bf16=True) does, where every framework's adapter GEMMs
are bf16. foak forms those fp32 products with foak.ops.lowrank's kernels (no fp32 copies); ``--torch-lowrank``
takes torch's fp32-copy path instead (foak.ops.lowrank.USE["cuda"] = False). ``--profile`` adds one profiled step
per run (its top kernels in the record).

    python benchmarks/long_context.py --out $OUT --lengths 131072 196608 --frameworks foak liger
    python benchmarks/long_context.py --cpu-smoke            # tiny dims on CPU: the code path only
    python benchmarks/long_context.py --check-offload        # GPU: offload_activations' correctness check
    python benchmarks/long_context.py --check-unsloth-env    # GPU: Unsloth's imports, versions, loss == HF's

Framework ``foak-offload``: foak's default switches plus ``offload_activations`` (the checkpointed layers'
inputs in pinned host memory; ``--offload-budget-gib`` caps it, default half the available RAM); its record says
how many layers were offloaded and how many bytes.

Frameworks: none (HF alone), liger, foak (foak.patch defaults), foak-tiled (defaults + tiled_mlp), foak-long
(defaults + both: what `foak train --long_context` runs), unsloth and unsloth-tiled (see below). A foak framework
with ``+cudnn`` (e.g. ``foak-long+cudnn``) adds the cudnn_attention switch (SDPA's cuDNN attention first).

Framework ``unsloth``: Unsloth's own path, as its users run it: ``FastLanguageModel.from_pretrained`` (bf16, or
``load_in_4bit`` with --qlora) and ``get_peft_model`` (LoRA r16 on every linear layer) with
``use_gradient_checkpointing="unsloth"`` (its offloaded checkpoints); ``unsloth-tiled`` adds its tiled MLP
(``unsloth_tiled_mlp=True``); all else at Unsloth's defaults (it may move the input embedding to the CPU when
memory is tight: the record says where it was). Unsloth loads from a directory, so a first
process saves the same random-init model (same seed, same weights as the other frameworks) with a tokenizer to
``--unsloth-model-dir`` (reused while its dims match; 16 GB for the 8B dims). Unsloth is imported only in its own
run's process. Its packages are not in the GPU image: ``benchmarks/wheels.py base trl`` and ``benchmarks/wheels.py
unsloth --dir .wheels_unsloth`` download them (Python 3.12 wheels; carry both folders), install them first on the
GPU machine with ``pip install -q --no-index --no-deps --no-compile --target /tmp/site`` and
``PYTHONPATH=/tmp/site``, then run ``--check-unsloth-env`` (GPU: versions, Unsloth's GPU backend and offloading
checkpoint, and Unsloth's loss == HF's on a small model at 4096 tokens).
With --cpu-smoke Unsloth picks its CPU backend (no GPU): that checks this script's plumbing, not Unsloth's GPU
path. Every framework trains on the same token ids (a seeded generator), so the losses are comparable.

``--pinned-register``: the children pin host memory with cudaHostRegister on 8 threads (torch allocator setting
``pinned_use_cuda_host_register``) instead of one cudaHostAlloc per block; ``--pin-probe GIB`` times both.
Lengths whose step outlasts one device command run detached: benchmarks/queue.sh with benchmarks/queues/*.txt.

Writes ``long_context_h200.json`` (one record per run: peak allocated GiB, step seconds, loss, or the error)
and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

DIMS_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=1 << 20, rope_theta=500000.0)
DIMS_TINY = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=301, max_position_embeddings=4096)
DIMS_CHECK = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1 << 16, rope_theta=500000.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Unsloth's process: nothing from the network (the GPU machine has none), its compile cache out of the repo
UNSLOTH_ENV = dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   UNSLOTH_DISABLE_STATISTICS="1",
                   UNSLOTH_COMPILE_LOCATION=os.path.join(tempfile.gettempdir(), "unsloth_compiled_cache"))
UNSLOTH_FRAMEWORKS = ("unsloth", "unsloth-tiled")
UNSLOTH_PACKAGES = ("unsloth", "unsloth_zoo", "torch", "transformers", "peft", "accelerate", "trl", "datasets",
                    "bitsandbytes", "triton", "xformers", "flash_attn", "pyarrow", "fsspec", "dill", "multiprocess")


def dims_of(name: str) -> dict:
    return {"8b": DIMS_8B, "tiny": DIMS_TINY, "check": DIMS_CHECK}[name]


def build_model(dims: str, device: str, dtype):
    """The random-init Llama every framework starts from (seed 0: the same weights in every process)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**dims_of(dims))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    return model, config


def token_ids(vocab_size: int, length: int, device: str):
    """Random tokens from their own seeded generator: the same ids for every framework at a length."""
    import torch

    generator = torch.Generator(device=device).manual_seed(1234)
    return torch.randint(3, vocab_size, (1, length), device=device, generator=generator)


def measure(model, framework: str, length: int, ids, smoke: bool, warmup: int, qlora: bool,
            reentrant: bool) -> dict:
    """Untimed warm-up steps, then one timed forward + backward; the peak over that step. With --autocast every
    step runs under torch.autocast(bf16), as HF's Trainer(bf16=True) runs its forward."""
    import contextlib

    import torch

    def step():
        with torch.autocast(ids.device.type, dtype=torch.bfloat16) if AUTOCAST else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    for _ in range(warmup):  # e.g. the first step's pinned host allocations (foak-offload) left out of the timing
        step()
        model.zero_grad(set_to_none=True)
    if not smoke:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    loss = step()
    if not smoke:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    record = {"framework": framework, "length": length, "reentrant": reentrant, "warmup_steps": warmup,
              "base": "nf4" if qlora else "bf16", "autocast": AUTOCAST,
              "lowrank_cuda": LOWRANK_CUDA if framework.startswith("foak") else None,  # foak's kernels only
              "loss": float(loss.detach()),
              "step_s": seconds, "tokens_per_s": length / seconds}
    if not smoke:
        record.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                      model_gib=base / 2**30, gpu=torch.cuda.get_device_name(0),
                      alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
        try:  # the pinned host allocator's own account (blocks, bytes, seconds in its CUDA calls), where torch has it
            stats = torch.cuda.memory.host_memory_stats()
            record["host_alloc"] = {k: stats.get(k) for k in ("allocated_bytes.current", "num_host_alloc",
                                                              "host_alloc_time.total")}
        except (AttributeError, RuntimeError):
            pass
        if PROFILE:
            model.zero_grad(set_to_none=True)
            record["profile"] = profile_step(step)
    return record


PROFILE = False  # --profile: one more step under torch.profiler after the timed one
AUTOCAST = False  # --autocast: every step under torch.autocast(bf16), as HF's Trainer(bf16=True) runs it
LOWRANK_CUDA = True  # foak's LoRA ops take foak.ops.lowrank's kernels on CUDA (fp32 adapters); --torch-lowrank: not


def profile_step(step, top: int = 30) -> list[dict]:
    """One more ``step()`` (forward + backward) under torch.profiler: its `top` CUDA kernels by GPU time
    (foak.bench.measure's kernel_times rows, the step's total first)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from foak.bench.measure import kernel_times

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return kernel_times(prof, top=top)


def one_run(framework: str, length: int, reentrant: bool, smoke: bool, budget_gib: float | None = None,
            warmup: int = 0, qlora: bool = False) -> dict:
    import peft
    import torch

    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    model, config = build_model("tiny" if smoke else "8b", device, dtype)
    if framework == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    if qlora:  # every decoder projection NF4 (double-quantized), as from_pretrained with a BitsAndBytesConfig
        from foak.bench.step import quantize_nf4

        quantize_nf4(model, device)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    model.train()
    report = None
    base, _, option = framework.partition("+")  # e.g. foak-long+cudnn: + the cudnn_attention switch
    if option not in ("", "cudnn"):
        raise ValueError(f"framework {framework!r}: the only option is +cudnn")
    if base in ("foak", "foak-offload", "foak-tiled", "foak-long"):
        import foak
        from foak.api import default_config
        from foak.ops import lowrank

        lowrank.USE["cuda"] = LOWRANK_CUDA
        # foak-offload: + offload_activations; foak-tiled: + tiled_mlp (chunks of the hidden size); foak-long: both
        extra = {}
        if base in ("foak-offload", "foak-long"):
            extra.update(offload_activations=True, offload_budget_gib=budget_gib)
        if base in ("foak-tiled", "foak-long"):
            extra.update(tiled_mlp=True)
        if option == "cudnn":
            extra.update(fast_packed_attention=True, cudnn_attention=True)
        report = foak.patch(model, default_config(model, **extra))
    ids = token_ids(config.vocab_size, length, device)
    record = measure(model, framework, length, ids, smoke, warmup, qlora, reentrant)
    if report is not None:
        record["report"] = str(report)
    if base in ("foak-offload", "foak-long"):
        from foak.patching.offload import state_of

        stacks = [m for m in model.modules() if "offloaded_layers" in state_of(m)]
        record["offload"] = {k: sum(state_of(m)[k] for m in stacks)
                             for k in ("layers", "offloaded_layers", "kept_layers", "leaf_layers", "offloaded_bytes")}
    record["versions"] = {m: __import__(m).__version__ for m in ("torch", "transformers", "peft")}
    return record


MARKER = "FOAK_CHECKPOINT.json"


def save_checkpoint(path: str, dims: str, smoke: bool, loss_length: int | None = None) -> dict:
    """The model every framework starts from (build_model), saved for Unsloth's from_pretrained: safetensors, its
    config, and a word-level tokenizer over the whole vocabulary. With loss_length: HF's loss on token_ids at that
    length, unpatched (Unsloth's process must not compute it: importing Unsloth patches transformers' Llama), bf16
    and then with the projections NF4 (as the other frameworks' --qlora runs quantize them)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models

    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    model, config = build_model(dims, device, dtype)
    meta = {"dims": dims_of(dims), "dtype": str(dtype), "seed": 0}
    os.makedirs(path, exist_ok=True)
    if os.path.exists(os.path.join(path, MARKER)):
        os.remove(os.path.join(path, MARKER))
    model.save_pretrained(path)
    if loss_length:
        from foak.bench.step import quantize_nf4

        ids = token_ids(config.vocab_size, loss_length, device)
        with torch.no_grad():
            meta.update(hf_loss=float(model(input_ids=ids, labels=ids).loss), hf_loss_length=loss_length)
            quantize_nf4(model, device)
            meta.update(hf_loss_nf4=float(model(input_ids=ids, labels=ids).loss))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"t{i}": i for i in range(4, config.vocab_size)})
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", unk_token="<unk>", model_max_length=config.max_position_embeddings)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, MARKER), "w") as f:  # written last: a half-saved directory has none
        json.dump(meta, f)
    return meta


def checkpoint_ready(path: str, dims: str) -> bool:
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f)["dims"] == dims_of(dims)
    except (OSError, ValueError, KeyError):
        return False


def unsloth_state(model) -> dict:
    """What Unsloth ran: its backend, the checkpointing mode, whether its offloading checkpoint function is
    installed, and (read from unsloth_zoo's module state, for the record only) the checkpointed layers and the
    host memory its offload buffers hold."""
    import torch
    import unsloth

    state = {"device_type": getattr(unsloth, "DEVICE_TYPE", None),
             "cpu_backend": bool(getattr(unsloth, "_IS_CPU_BACKEND", False)),
             "gradient_checkpointing": str(getattr(model, "_unsloth_gradient_checkpointing", None)),
             "offloading_checkpoint": torch.utils.checkpoint.CheckpointFunction.__name__ == "UnslothCheckpointFunction",
             "embedding_device": str(model.get_input_embeddings().weight.device),
             "tiled_mlp_modules": sum(name.endswith(".mlp") and "_unsloth_forward" in vars(module)
                                      for name, module in model.named_modules())}
    gc = sys.modules.get("unsloth_zoo.gradient_checkpointing")
    if gc is not None:
        buffers = [b for b in getattr(gc, "CPU_BUFFERS", None) or [] if torch.is_tensor(b)]
        state.update(checkpointed_layers=getattr(gc, "LAST_GC_INDEX", None),
                     host_buffer_gib=sum(b.untyped_storage().nbytes() for b in buffers) / 2**30,
                     host_buffers_pinned=sum(bool(getattr(b, "_unsloth_is_pinned", False)) for b in buffers))
    try:
        from unsloth.models import _utils as unsloth_utils

        state["attention"] = {"xformers": bool(getattr(unsloth_utils, "HAS_XFORMERS", False)),
                              "flash_attn": bool(getattr(unsloth_utils, "HAS_FLASH_ATTENTION", False))}
    except ImportError:
        pass
    return state


def package_versions() -> dict:
    from importlib import metadata

    versions = {}
    for name in UNSLOTH_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def unsloth_run(framework: str, length: int, smoke: bool, warmup: int, qlora: bool, model_dir: str) -> dict:
    """Unsloth's own loading, LoRA and offloaded gradient checkpointing on the saved model (save_checkpoint);
    unsloth-tiled: + its tiled MLP (``unsloth_tiled_mlp=True``). Everything else at Unsloth's defaults."""
    os.environ.update(UNSLOTH_ENV)
    import unsloth  # noqa: F401  (first, as Unsloth asks: it patches transformers and peft before they are used)
    from unsloth import FastLanguageModel

    import torch

    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    with open(os.path.join(model_dir, MARKER)) as f:
        meta = json.load(f)
    model, _ = FastLanguageModel.from_pretrained(model_dir, max_seq_length=length, dtype=dtype, load_in_4bit=qlora,
                                                 local_files_only=True, use_gradient_checkpointing="unsloth",
                                                 unsloth_tiled_mlp=framework == "unsloth-tiled")
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0, bias="none",
                                             target_modules=TARGETS, use_gradient_checkpointing="unsloth",
                                             random_state=0)
    model.train()
    ids = token_ids(meta["dims"]["vocab_size"], length, device)
    record = measure(model, framework, length, ids, smoke, warmup, qlora, reentrant=None)
    record["unsloth"] = unsloth_state(model)
    record["versions"] = package_versions()
    if meta.get("hf_loss_length") == length:  # --check-unsloth-env's model: HF's loss on the same tokens
        record["hf_loss"] = meta["hf_loss_nf4" if qlora else "hf_loss"]
    return record


def alloc_conf() -> str:
    """The CUDA allocator settings every child process runs with (recorded in its record); --pinned-register adds
    the pinned host settings foak train uses for a run that offloads (foak.alloc_conf)."""
    from foak.alloc_conf import PINNED_HOST_TEXT

    extra = os.environ.get("FOAK_BENCH_PINNED_REGISTER") == "1"
    return "expandable_segments:True" + ("," + PINNED_HOST_TEXT if extra else "")


def host_available_gib() -> float | None:
    """The host's MemAvailable (GiB) from /proc/meminfo; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 2**20
    except (OSError, StopIteration):
        return None


def run_child(args: list[str], timeout: float) -> tuple[dict | None, str]:
    """This script in a new process; its RESULT line as a dict (None if it printed none) and what ended it: the
    last line of its output and, when it printed no result, its exit status (a signal by name: SIGKILL is most
    often the host's OOM killer) and the lowest host MemAvailable seen while it ran (sampled every second)."""
    command = [sys.executable, __file__, *args]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True,
                                 env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=alloc_conf()))
        end, lowest = time.monotonic() + timeout, host_available_gib()
        while child.poll() is None:
            if time.monotonic() > end:
                child.kill()
                child.wait()
                raise subprocess.TimeoutExpired(command, timeout)
            time.sleep(1)
            now = host_available_gib()
            if now is not None and (lowest is None or now < lowest):
                lowest = now
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    line = next((text for text in stdout.splitlines() if text.startswith("RESULT ")), None)
    if line:
        record = json.loads(line[len("RESULT "):])
        if isinstance(record, dict) and lowest is not None:
            record["host_min_available_gib"] = round(lowest, 1)
        return record, ""
    tail = ((stderr or stdout).strip().splitlines()[-1:] or ["no output"])[0][:300]
    code = child.returncode
    status = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
    host = f", host MemAvailable fell to {lowest:.1f} GiB" if lowest is not None else ""
    return None, f"{status}{host}; last line: {tail}"


def check_unsloth_env(model_dir: str, timeout: float, smoke: bool) -> list[dict]:
    """GPU, run first: Unsloth imports from the carried wheels, its GPU backend is on with its offloading
    checkpoint, and its training step on a small model (2 layers, hidden 512, 4096 tokens: each layer input over
    its 2 MB offload threshold) gives HF's loss on the same weights and tokens, bf16 and NF4 (load_in_4bit vs
    bitsandbytes NF4 of the same weights): within 0.02. With smoke (CPU): Unsloth's CPU backend, fp32, 1e-4 (NF4:
    1e-3, the HF side computes in bf16)."""
    length, smoke_flag = 4096, ["--cpu-smoke"] * smoke
    try:
        meta, tail = run_child(["--save-checkpoint", model_dir, "--dims", "check", "--loss-length", str(length),
                                *smoke_flag], timeout)
    except subprocess.TimeoutExpired:
        meta, tail = None, f"timeout {timeout} s"
    if meta is None:
        return [{"check": "unsloth-env", "ok": False, "stage": "save", "error": tail}]
    checks = []
    for qlora in (False, True):
        name = f"unsloth-env/{'nf4' if qlora else 'bf16'}"
        hf_loss = meta["hf_loss_nf4" if qlora else "hf_loss"]
        try:
            record, tail = run_child(["--one", "unsloth", str(length), "--unsloth-model-dir", model_dir,
                                      *smoke_flag, *["--qlora"] * qlora], timeout)
        except subprocess.TimeoutExpired:
            record, tail = None, f"timeout {timeout} s"
        if record is None:
            checks.append({"check": name, "ok": False, "stage": "unsloth", "error": tail, "hf_loss": hf_loss})
            continue
        state = record["unsloth"]
        if smoke:
            ok = state["cpu_backend"] and abs(record["loss"] - hf_loss) <= (1e-3 if qlora else 1e-4)
        else:
            ok = (not state["cpu_backend"] and state["device_type"] == "cuda" and state["offloading_checkpoint"]
                  and bool(state.get("checkpointed_layers")) and abs(record["loss"] - hf_loss) <= 0.02)
        checks.append({"check": name, "ok": ok, "loss": record["loss"], "hf_loss": hf_loss,
                       "peak_gib": record.get("peak_gib"), "step_s": record["step_s"], "unsloth": state,
                       "versions": record["versions"]})
    return checks


def offloaded(record: dict) -> str:
    o, u = record.get("offload"), record.get("unsloth")
    if u:  # Unsloth's checkpointing as it reports itself
        return (f"unsloth {u['device_type']}{' CPU backend' if u['cpu_backend'] else ''}, checkpointing "
                f"{u['gradient_checkpointing']}, offloading {u['offloading_checkpoint']}, "
                f"{u['tiled_mlp_modules']} tiled MLPs, embedding on {u['embedding_device']}"
                + (f", {u['host_buffer_gib']:.1f} GiB host buffers" if "host_buffer_gib" in u else ""))
    return "" if not o else (f"{o['offloaded_layers']} of {o['layers']} layers offloaded "
                             f"({o['offloaded_bytes'] / 2**30:.1f} GiB pinned"
                             + (f"; {o['leaf_layers']} a graph leaf, kept" if o.get("leaf_layers") else "") + ")")


def offload_check(reentrant: bool) -> dict:
    """On the GPU (a check, not timed): foak with offload_activations vs the same model without, a 6-layer Llama
    (hidden 256) at 4096 tokens, fp32: the same loss and gradients (1e-5), pinned host copies, and what the
    forward leaves allocated on the GPU drops by at least all but one layer input."""
    import copy

    import torch
    import transformers

    import foak
    from foak.patching import offload

    config = transformers.LlamaConfig(**{**DIMS_TINY, "num_hidden_layers": 6, "hidden_size": 256,
                                         "intermediate_size": 512})
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).float().cuda()
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ref.enable_input_require_grads()
    ref.train()
    model = copy.deepcopy(ref)
    foak.patch(model, offload_activations=True)
    hosts, real = [], offload._host_buffer
    offload._host_buffer = lambda t: hosts.append(real(t)) or hosts[-1]
    ids = torch.randint(3, config.vocab_size, (1, 4096), device="cuda")

    def run(m):
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = m(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        loss.backward()
        return kept, loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    try:
        run(ref)  # warm-up (cuBLAS workspaces)
        (base, loss_ref, grads_ref), (ours, loss, grads) = run(ref), run(model)
    finally:
        offload._host_buffer = real
    per_layer = 4096 * 256 * 4
    worst = max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in grads_ref.items())
    ok = (base - ours >= (config.num_hidden_layers - 1) * per_layer and bool(hosts)
          and all(h.is_pinned() for h in hosts) and abs(float(loss - loss_ref)) <= 1e-5 * abs(float(loss_ref))
          and worst <= 1e-5 and grads.keys() == grads_ref.keys())
    return {"check": f"offload/{'reentrant' if reentrant else 'nonreentrant'}", "ok": ok,
            "kept_without_mib": base / 2**20, "kept_with_mib": ours / 2**20, "host_copies": len(hosts),
            "pinned": all(h.is_pinned() for h in hosts), "worst_grad_rel": worst}


def pin_probe(gib: float) -> dict:
    """Seconds to pin ``gib`` GiB of host memory in 256 MiB blocks (offload's pieces) and to copy a device tensor
    of that size into it, under this process's allocator settings."""
    import torch

    piece = 1 << 28
    src = torch.empty(piece, dtype=torch.uint8, device="cuda").random_()
    torch.cuda.synchronize()
    start = time.perf_counter()
    blocks = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(int(gib * 4))]
    pinned = time.perf_counter() - start
    start = time.perf_counter()
    for block in blocks:
        block.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    copied = time.perf_counter() - start
    return {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "gib": len(blocks) / 4,
            "pin_s": pinned, "pin_gib_per_s": len(blocks) / 4 / pinned, "d2h_gib_per_s": len(blocks) / 4 / copied,
            "all_pinned": all(b.is_pinned() for b in blocks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--lengths", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--frameworks", nargs="+", default=["none", "liger", "foak"])
    parser.add_argument("--reentrant", action="store_true")
    parser.add_argument("--qlora", action="store_true", help="NF4 (bitsandbytes) base under the LoRA adapters")
    parser.add_argument("--json-name", default=None, help="result file name (default long_context_h200.json)")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--one", nargs=2, metavar=("FRAMEWORK", "LENGTH"))
    parser.add_argument("--check-offload", action="store_true",
                        help="GPU: offloaded == not offloaded, pinned host copies, layer inputs off the GPU")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--stop-on-fail", action="store_true",
                        help="after a framework fails (OOM, timeout) at one length, skip its longer lengths")
    parser.add_argument("--autocast", action="store_true",
                        help="every step under torch.autocast(bf16), as HF's Trainer(bf16=True) runs its forward "
                             "(PEFT's fp32 adapters then compute in bf16)")
    parser.add_argument("--torch-lowrank", action="store_true",
                        help="foak's LoRA ops form fp32 adapter products on CUDA through torch's fp32-copy path, not "
                             "foak.ops.lowrank's kernels (the default)")
    parser.add_argument("--lowrank-cuda", action="store_true", help=argparse.SUPPRESS)  # the default now (old queues)
    parser.add_argument("--profile", action="store_true",
                        help="GPU: one more step under torch.profiler; its top kernels go into the record")
    parser.add_argument("--warmup-steps", type=int, default=0, help="untimed steps before the measured one")
    parser.add_argument("--offload-budget-gib", type=float, default=None,
                        help="foak-offload: host memory for offloaded layer inputs (default: half the available RAM)")
    parser.add_argument("--check-unsloth-env", action="store_true",
                        help="GPU, run first: Unsloth's imports and versions, its GPU backend, its loss == HF's")
    parser.add_argument("--unsloth-model-dir", default=None,
                        help="where the model Unsloth loads is saved (default: under the temp dir, per dims)")
    parser.add_argument("--pinned-register", action="store_true",
                        help="children pin host memory by cudaHostRegister on 8 threads (torch allocator setting)")
    parser.add_argument("--pin-probe", type=float, metavar="GIB", default=None,
                        help="GPU: time pinning GIB of host memory in 256 MiB blocks, as offload does, and exit")
    parser.add_argument("--save-checkpoint", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--pin-probe-child", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dims", choices=["8b", "tiny", "check"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--loss-length", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global PROFILE, AUTOCAST, LOWRANK_CUDA
    PROFILE, AUTOCAST, LOWRANK_CUDA = args.profile, args.autocast, not args.torch_lowrank
    if args.pinned_register:
        os.environ["FOAK_BENCH_PINNED_REGISTER"] = "1"
    if args.pin_probe is not None:
        for register in (False, True):
            os.environ["FOAK_BENCH_PINNED_REGISTER"] = "1" if register else "0"
            try:
                record, tail = run_child(["--pin-probe-child", str(args.pin_probe)], args.timeout)
            except subprocess.TimeoutExpired:
                record, tail = None, f"timeout {args.timeout} s"
            print("PIN " + json.dumps(record or {"register": register, "error": tail}), flush=True)
        return
    if args.pin_probe_child is not None:
        print("RESULT " + json.dumps(pin_probe(args.pin_probe_child)))
        return
    dims = args.dims or ("tiny" if args.cpu_smoke else "8b")
    model_dir = args.unsloth_model_dir or os.path.join(tempfile.gettempdir(), f"foak_long_context_{dims}")
    if args.check_offload:
        for reentrant in (False, True):
            print("CHECK " + json.dumps(offload_check(reentrant)), flush=True)
        return
    if args.check_unsloth_env:
        check_dir = args.unsloth_model_dir or os.path.join(tempfile.gettempdir(), "foak_long_context_check")
        for check in check_unsloth_env(check_dir, args.timeout, args.cpu_smoke):
            print("CHECK " + json.dumps(check), flush=True)
        return
    if args.save_checkpoint:
        print("RESULT " + json.dumps(save_checkpoint(args.save_checkpoint, dims, args.cpu_smoke, args.loss_length)))
        return
    if args.one:
        if args.one[0] in UNSLOTH_FRAMEWORKS:
            record = unsloth_run(args.one[0], int(args.one[1]), args.cpu_smoke, args.warmup_steps, args.qlora,
                                 model_dir)
        else:
            record = one_run(args.one[0], int(args.one[1]), args.reentrant, args.cpu_smoke,
                             args.offload_budget_gib, args.warmup_steps, args.qlora)
        print("RESULT " + json.dumps(record))
        return
    lengths = [64, 256] if args.cpu_smoke else args.lengths
    frameworks = [f for f in args.frameworks if not (args.cpu_smoke and f == "liger")]
    records, failed = [], set()
    unsloths = [f for f in frameworks if f in UNSLOTH_FRAMEWORKS]
    if unsloths and not checkpoint_ready(model_dir, dims):  # Unsloth loads from a directory
        try:
            saved, tail = run_child(["--save-checkpoint", model_dir, "--dims", dims] + ["--cpu-smoke"] * args.cpu_smoke,
                                    args.timeout)
        except subprocess.TimeoutExpired:
            saved, tail = None, f"timeout {args.timeout} s"
        if saved is None:
            failed.update(unsloths)
            records += [{"framework": f, "length": n, "error": f"saving the model: {tail}"}
                        for n in lengths for f in unsloths]
    for length in lengths:
        for framework in frameworks:
            if framework in failed:  # --stop-on-fail: a framework that failed a shorter length is not run again
                continue
            command = ["--one", framework, str(length)]
            command += ["--reentrant"] * args.reentrant + ["--cpu-smoke"] * args.cpu_smoke + ["--qlora"] * args.qlora
            command += ["--warmup-steps", str(args.warmup_steps)]
            command += ["--profile"] * args.profile + ["--autocast"] * args.autocast
            command += ["--torch-lowrank"] * args.torch_lowrank
            if args.offload_budget_gib is not None:
                command += ["--offload-budget-gib", str(args.offload_budget_gib)]
            if framework in UNSLOTH_FRAMEWORKS:
                command += ["--unsloth-model-dir", model_dir]
            try:
                record, tail = run_child(command, args.timeout)
                record = record or {"framework": framework, "length": length, "error": tail}
            except subprocess.TimeoutExpired:
                record = {"framework": framework, "length": length, "error": f"timeout {args.timeout} s"}
            records.append(record)
            if args.stop_on_fail and "error" in record:
                failed.add(framework)
            print(json.dumps({k: v for k, v in record.items() if k != "report"}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    name = args.json_name or ("long_context_smoke.json" if args.cpu_smoke else "long_context_h200.json")
    path = os.path.join(args.out, name)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {path}\n| framework | base | length | peak GiB | step s | tokens/s | loss | note |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in records:
        base = r.get("base", "nf4" if args.qlora else "bf16")
        print(f"| {r['framework']} | {base} | {r['length']} | {r.get('peak_gib', float('nan')):.1f} | "
              f"{r.get('step_s', float('nan')):.1f} | {r.get('tokens_per_s', float('nan')):.0f} | "
              f"{r.get('loss', float('nan')):.4f} | {r.get('error', '') or offloaded(r)} |")


if __name__ == "__main__":
    main()
