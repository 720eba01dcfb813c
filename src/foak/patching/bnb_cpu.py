"""bitsandbytes' CPU 4-bit dequantization, checked against the NF4 formula once per process.

On a CPU with AVX-512, bitsandbytes 0.50.2's CPU ``dequantize_4bit`` (what its ``Linear4bit`` runs forward and
backward on CPU, so what PEFT's QLoRA layers compute with) takes a vectorized path that gives part of a weight
row the wrong block scale when the row's length is not a multiple of the block size: a [129, 160] weight in
blocks of 64 is wrong from element 192 on (relative error about 0.25). foak's fused QLoRA path dequantizes
with its own kernel (foak.ops.nf4) and is not affected; a 4-bit layer that runs bitsandbytes' own forward is.

Nothing here reads a CPU flag: a small weight is quantized by bitsandbytes, dequantized by it and by the NF4
formula (:func:`foak.ops.nf4.nf4_dequantize_reference` with :data:`foak.ops.nf4.NF4_LEVELS`, the double-quantized
scales decoded by the formula too), and the two are compared bit for bit; each answer is cached.

- :func:`dequant_problem`: one fixed probe; what the tests ask before they compare anything with bitsandbytes.
- :func:`check_model`: ``foak.patch`` and ``foak train`` on a model with NF4 layers on the CPU: one probe per
  distinct (row length, block size, dtype, nesting) of its layers, a warning (once per process) and the
  patch report's note when some of them come out wrong.
"""

from __future__ import annotations

import functools
import platform
import sys
import warnings

import torch

from foak.ops.nf4 import NF4_LEVELS, nf4_dequantize_reference

# the fixed probe: several blocks per row, rows not a multiple of the block size (what the AVX-512 path gets
# wrong), and two nested blocks of 256 scales
PROBE_SHAPE, PROBE_BLOCKSIZE = (129, 160), 64
# a relative error above this is a wrong weight, not a rounding difference (a wrong scale gives ~0.1 to 1)
WRONG = 1e-2


def bnb_version() -> str:
    import bitsandbytes

    return getattr(bitsandbytes, "__version__", "?")


def cpu_description() -> str:
    """The CPU's model name (Linux) and the SIMD level torch dispatches to, e.g. 'Intel(R) Xeon(R) ..., AVX512'."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    name = name or platform.processor()
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{name}, {capability}" if name else capability


@functools.lru_cache(maxsize=None)
def probe(rows: int, cols: int, blocksize: int, dtype: torch.dtype, nested: bool) -> float:
    """Relative error of bitsandbytes' CPU ``dequantize_4bit`` against the NF4 formula on a fixed [rows, cols]
    weight it quantized itself (0.0: bit-exact). Cached."""
    import bitsandbytes.functional as bnbf

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(rows, cols, generator=gen) * 0.02).to(dtype)
    # eager: the torch fallback bitsandbytes takes for some shapes is torch.compile'd (seconds per shape)
    with torch.compiler.set_stance("force_eager"):
        packed, state = bnbf.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")
        theirs = bnbf.dequantize_4bit(packed, state, quant_type="nf4")
    kwargs = {}
    if state.nested:
        kwargs = {"nested_absmax": state.state2.absmax, "nested_code": state.state2.code,
                  "nested_blocksize": state.state2.blocksize, "offset": state.offset}
    ours = nf4_dequantize_reference(packed.view(torch.uint8).reshape(-1), state.absmax, tuple(state.shape),
                                    state.dtype, code=torch.tensor(NF4_LEVELS), blocksize=state.blocksize, **kwargs)
    if theirs.shape == ours.shape and torch.equal(theirs, ours):
        return 0.0
    if theirs.shape != ours.shape:
        return float("inf")
    diff = (theirs.double() - ours.double()).norm().item()
    return diff / max(ours.double().norm().item(), 1e-30)


@functools.cache
def dequant_problem() -> str | None:
    """Why bitsandbytes' CPU ``dequantize_4bit`` cannot be compared with here (it differs from the NF4 formula
    on the fixed probe: double-quantized in fp32, plain in bf16), naming the bitsandbytes version and the CPU;
    None when it agrees bit for bit (or bitsandbytes is not installed)."""
    try:
        import bitsandbytes.functional  # noqa: F401
    except ImportError:
        return None
    rows, cols = PROBE_SHAPE
    worst = max(probe(rows, cols, PROBE_BLOCKSIZE, dtype, nested)
                for dtype, nested in ((torch.float32, True), (torch.bfloat16, False)))
    if worst == 0.0:
        return None
    return (f"bitsandbytes {bnb_version()}'s CPU dequantize_4bit differs from the NF4 formula on this CPU "
            f"({cpu_description()}): relative error {worst:.2g} on a [{rows}, {cols}] NF4 weight in blocks of "
            f"{PROBE_BLOCKSIZE}")


def forget() -> None:
    """Drop the cached answers (after bitsandbytes' CPU kernel was replaced or restored, e.g. by foak.testing)."""
    probe.cache_clear()
    dequant_problem.cache_clear()


_WARNED: set[str] = set()


def check_model(model, stacklevel: int = 2) -> str | None:
    """For a model holding bitsandbytes NF4 ``Linear4bit`` layers on the CPU: if bitsandbytes' CPU dequantization
    is wrong here for some of them (their row length, block size, dtype), warn once per process and return the
    patch report's note; None otherwise (no such layer, or every one of them dequantizes right). ``stacklevel``:
    the warning's, as for warnings.warn (2: the caller of this function)."""
    bnb_nn = sys.modules.get("bitsandbytes.nn")
    if bnb_nn is None:
        return None
    groups: dict[tuple, int] = {}
    for m in model.modules():
        weight = getattr(m, "weight", None)
        state = getattr(weight, "quant_state", None)
        if not isinstance(m, bnb_nn.Linear4bit) or state is None or weight.device.type != "cpu" \
                or state.quant_type != "nf4" or getattr(state, "packing_format_for_cpu", False) \
                or len(state.shape) != 2:
            continue
        key = (int(state.shape[1]), int(state.blocksize), state.dtype, bool(state.nested))
        groups[key] = groups.get(key, 0) + 1
    if not groups or dequant_problem() is None:
        return None
    wrong = {key: probe(3, *key) for key in groups}
    wrong = {key: err for key, err in wrong.items() if err > WRONG}
    if not wrong:
        return None
    n_wrong, n_all = sum(groups[k] for k in wrong), sum(groups.values())
    widths = ", ".join(str(w) for w in sorted({k[0] for k in wrong}))
    what = (f"bitsandbytes {bnb_version()}'s CPU dequantize_4bit is wrong on this CPU ({cpu_description()}) for "
            f"{n_wrong} of the model's {n_all} NF4 layers (in_features {widths}; relative error up to "
            f"{max(wrong.values()):.2g})")
    message = (f"{what}: foak's fused QLoRA path (its own NF4 dequantization) is unaffected, but those layers "
               "compute with wrong weights wherever bitsandbytes' own forward runs (PEFT's path, layers foak does "
               "not patch, --acceleration_config none); train on a GPU or with a bitsandbytes release that fixes it")
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
    return (f"bitsandbytes {bnb_version()} CPU dequantize_4bit wrong here for {n_wrong}/{n_all} NF4 layers "
            f"(in_features {widths}): foak's fused path unaffected, bitsandbytes' forward (PEFT's path, unpatched "
            "layers) is not")
