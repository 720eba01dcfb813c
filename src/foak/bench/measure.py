"""Timing, memory and environment measurements shared by ``foak bench`` and the scripts in ``benchmarks/``.

GPU timers (CUDA events):

- :func:`event_median_ms`: median of ``reps`` calls, each between two events with a synchronize after it
  (what the benchmarks called ``timed_ms``); the host's launch time of the call is included.
- :func:`spin_median_ms`: the same, but a spin kernel keeps the GPU busy before each call so that the whole
  call is queued before the GPU reaches it: the events time the kernels, not Python's launch overhead
  (what ``benchmarks/ops.py`` called ``cuda_median_ms``).
- :func:`graph_ms`: per-call time of ``calls`` calls captured in one CUDA graph and replayed.

Memory: :func:`peak_memory` (torch's allocated / reserved peaks on CUDA, the process's max RSS on CPU),
:class:`SmiSampler` (nvidia-smi's view of the GPUs while a block runs, when nvidia-smi exists).
Environment: :func:`environment` (GPU, driver, package versions, foak's git commit).
Checks: :class:`CheckLog` (the pass/fail records the scripts' correctness checks write), :func:`overridden`
(a call with a settings dict, e.g. an op's TUNING, changed for its duration).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import resource
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch

MiB = 2**20
GiB = 2**30
SPIN_CYCLES = 20_000_000  # ~10 ms at the H200's 1.98 GHz: longer than any benchmarked call's host issue time
PACKAGES = ("torch", "triton", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "liger-kernel")


# ---- timers ----------------------------------------------------------------------------------------------
def event_median_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    """Median CUDA-event time of ``fn()`` in ms over ``reps`` calls after ``warmup`` calls (host launch time
    included: each call is timed from the moment it starts being issued)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def spin_median_ms(run, prepare=lambda: (), warmup: int = 10, reps: int = 50, host_times: list | None = None,
                   spin_cycles: int = SPIN_CYCLES) -> float:
    """Median GPU time (CUDA events) of ``run(*prepare())``; ``prepare()`` is enqueued outside the events.

    Before each timed call the GPU is kept busy by a spin kernel, so the host has queued the whole call before
    the GPU reaches it: the events then time the kernels, not Python's launch overhead (which a training step
    hides behind other layers' GPU work). The host's issue time of each call is appended to ``host_times``
    (ms) when a list is given."""
    for _ in range(warmup):
        run(*prepare())
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        args = prepare()
        torch.cuda._sleep(spin_cycles)
        start.record()
        t0 = time.perf_counter()
        run(*args)
        if host_times is not None:
            host_times.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()  # one call at a time: the spin must cover only that call's issue time
    return statistics.median(s.elapsed_time(e) for s, e in events)


def graph_ms(fn, calls: int = 20, reps: int = 20) -> float:
    """Per-call time of ``fn`` with the host out of the way: ``calls`` calls captured in a CUDA graph, the
    replay timed by :func:`event_median_ms`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ms = event_median_ms(graph.replay, reps=reps, warmup=3) / calls
    del graph
    return ms


def copy_bandwidth(nbytes: int = 2 * GiB) -> float:
    """Device copy bandwidth in bytes/s (read + write) of an ``nbytes`` uint8 copy."""
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = spin_median_ms(lambda: dst.copy_(src), warmup=5, reps=20)
    return 2 * src.numel() / (ms * 1e-3)


class StepTimer:
    """Per-step wall times of a loop without a host synchronisation per step: on CUDA an event is recorded at
    each step boundary and read once at the end; on CPU (synchronous) the host clock is read."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def step_ms(self) -> list[float]:
        """Milliseconds between consecutive marks (synchronizes once on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def relative_spread(values) -> float:
    """(max - min) / median of ``values`` (0 for fewer than two): a run's noise band."""
    values = [float(v) for v in values]
    if len(values) < 2:
        return 0.0
    median = statistics.median(values)
    return (max(values) - min(values)) / median if median else 0.0


# ---- memory ----------------------------------------------------------------------------------------------
def kernel_times(profiler, top: int = 40, cpu: bool = False) -> list[dict]:
    """A finished torch.profiler run's kernels (``cpu``: CPU ops instead), self time summed per name, largest
    first, as ``{"name", "calls", "ms"}`` rows after a ``(total)`` row."""
    rows = []
    for event in profiler.key_averages():
        us = event.self_cpu_time_total if cpu else event.self_device_time_total
        if us:
            rows.append({"name": event.key[:120], "calls": event.count, "ms": us / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    total = {"name": "(total)", "calls": sum(r["calls"] for r in rows), "ms": sum(r["ms"] for r in rows)}
    return [total] + rows[:top]


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::_scaled_mm")


def _has_gemm_parent(event) -> bool:
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if parent.name in GEMM_OPS:
            return True
        parent = getattr(parent, "cpu_parent", None)
    return False


def gemm_shapes(profiler, top: int = 40) -> list[dict]:
    """A finished torch.profiler run (``record_shapes=True``): the matrix products' device time per (op, input
    shapes, input strides), largest first, as ``{"name", "shapes", "strides", "calls", "ms"}`` rows: which GEMM
    of the step a kernel name's time belongs to, and whether an operand arrived transposed."""
    rows: dict[tuple, dict] = {}
    for event in profiler.events():
        if event.name not in GEMM_OPS or _has_gemm_parent(event):
            continue  # a product dispatched again inside another (under a dispatch mode) counts once
        shapes = [list(s) for s in event.input_shapes if s]
        # strides: a hint where the profiler records them (structured_input_strides in recent torch)
        recorded = getattr(event, "structured_input_strides", None) or getattr(event, "input_strides", None) or []
        strides = [list(s) for s in recorded if s and all(isinstance(x, int) for x in s)]
        key = (event.name, str(shapes), str(strides))
        row = rows.setdefault(key, {"name": event.name, "shapes": shapes, "strides": strides, "calls": 0, "ms": 0.0})
        row["calls"] += 1
        row["ms"] += (getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0) or 0) / 1e3
    return sorted(rows.values(), key=lambda r: -r["ms"])[:top]


class GemmLayouts:
    """Counts the matrix products run inside it by (op, input shapes, input strides, which inputs start at a
    128-byte-aligned address): the layouts cuBLAS sees, which the profiler of torch 2.11 does not record. Use
    around one untimed step (a dispatch mode adds host time to every op)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict[tuple, int] = {}
        gemms = {getattr(torch.ops.aten, name.split("::")[1]) for name in GEMM_OPS
                 if hasattr(torch.ops.aten, name.split("::")[1])}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket in gemms:
                    tensors = [a for a in args if isinstance(a, torch.Tensor)]
                    key = (str(func.overloadpacket), str([list(t.shape) for t in tensors]),
                           str([list(t.stride()) for t in tensors]),
                           "".join("a" if t.data_ptr() % 128 == 0 else "u" for t in tensors))
                    counts[key] = counts.get(key, 0) + 1
                return func(*args, **(kwargs or {}))

        self.counts, self._mode = counts, Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def rows(self) -> list[dict]:
        return [{"name": k[0], "shapes": k[1], "strides": k[2], "aligned": k[3], "calls": n}
                for k, n in sorted(self.counts.items(), key=lambda kv: (kv[0][1], -kv[1]))]


def reset_peak_memory(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device: torch.device | str) -> dict:
    """Peaks since the last :func:`reset_peak_memory`: on CUDA torch's max allocated and reserved (GiB); on CPU
    the process's max resident set (GiB, over the whole process life: the OS keeps no resettable peak)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / GiB,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB, "peak_rss_gib": _max_rss_gib()}
    return {"peak_allocated_gib": None, "peak_reserved_gib": None, "peak_rss_gib": _max_rss_gib()}


def _max_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # ru_maxrss is in KiB on Linux


def peak_extra_mib(fn, device: torch.device | str = "cuda") -> tuple[float, object]:
    """(peak memory allocated while ``fn()`` runs beyond what was allocated before it, in MiB; fn's result).
    The result is returned so that the caller decides when what it holds is freed."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / MiB, result


def nvidia_smi(*fields: str, index: int | None = None) -> list[list[str]] | None:
    """``nvidia-smi --query-gpu=FIELDS`` as rows of strings (one per GPU, or GPU ``index``); None without
    nvidia-smi or when it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    cmd = [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
    if index is not None:
        cmd.append(f"--id={index}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[cell.strip() for cell in line.split(",")] for line in out.strip().splitlines() if line.strip()]


class SmiSampler:
    """nvidia-smi's view of one GPU while the ``with`` block runs: one ``nvidia-smi --query-gpu ... -lms``
    process samples memory used and utilization every ``interval_ms``; ``peak_used_mib`` (the device's whole
    memory in use: other processes and the CUDA context included) and ``mean_utilization`` (percent). Both None
    without nvidia-smi or a CUDA device, or when the block ended before the first sample."""

    def __init__(self, device: torch.device | str, interval_ms: int = 200):
        device = torch.device(device)
        self.index = None
        self.exe = shutil.which("nvidia-smi")
        if device.type == "cuda" and self.exe:
            self.index = _physical_index(device.index if device.index is not None else torch.cuda.current_device())
        self.interval_ms = interval_ms
        self.used: list[float] = []
        self.util: list[float] = []
        self._proc = None
        self._thread = None

    def _read(self):
        for line in self._proc.stdout:
            cells = [c.strip() for c in line.split(",")]
            try:
                self.used.append(float(cells[0]))
                self.util.append(float(cells[1]))
            except (ValueError, IndexError):
                continue

    def __enter__(self):
        if self.index is not None:
            try:
                self._proc = subprocess.Popen(
                    [self.exe, "--query-gpu=memory.used,utilization.gpu", "--format=csv,noheader,nounits",
                     f"--id={self.index}", f"-lms={self.interval_ms}"],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self._proc = None
            if self._proc is not None:
                self._thread = threading.Thread(target=self._read, daemon=True)
                self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            time.sleep(self.interval_ms / 1e3)  # one more sample of the block's end state
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._thread.join(timeout=10)

    @property
    def peak_used_mib(self) -> float | None:
        return max(self.used) if self.used else None

    @property
    def mean_utilization(self) -> float | None:
        return sum(self.util) / len(self.util) if self.util else None


def _physical_index(logical: int) -> int:
    """nvidia-smi numbers GPUs physically; CUDA_VISIBLE_DEVICES renumbers them for torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if logical < len(ids) and ids[logical].isdigit():
            return int(ids[logical])
    return logical


# ---- environment -----------------------------------------------------------------------------------------
def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(path: str | os.PathLike | None = None) -> str | None:
    """The commit of the git checkout holding ``path`` (default: foak's own source), with ``-dirty`` when
    tracked files differ from it; None outside a checkout or without git."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    if shutil.which("git") is None:
        return None
    try:
        commit = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "") if commit else None


def environment(init_cuda: bool = True) -> dict:
    """Where a measurement ran: date, host's Python, GPU name/count/driver/CUDA (or 'cpu'), the versions of
    torch, triton, transformers, peft, accelerate, bitsandbytes, trl, liger-kernel (None when not installed),
    foak's version and git commit. ``init_cuda=False``: GPU facts from nvidia-smi only, so that this process
    creates no CUDA context (``foak bench``'s runner, whose experiments run in other processes)."""
    import foak

    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "platform": platform.platform()}
    if torch.cuda.is_available():
        rows = nvidia_smi("name", "driver_version", "memory.total", index=_physical_index(0))
        env["gpu"] = rows[0][0] if rows else (torch.cuda.get_device_name(0) if init_cuda else "cuda")
        env["gpu_count"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
        env["driver"] = rows[0][1] if rows else None
        env["gpu_memory_mib"] = float(rows[0][2]) if rows else (
            torch.cuda.get_device_properties(0).total_memory / MiB if init_cuda else None)
    else:
        env.update(gpu="cpu", gpu_count=0, cuda=None, driver=None, gpu_memory_mib=None)
    for dist in PACKAGES:
        env[dist.replace("-", "_")] = package_version(dist)
    env["torch"] = torch.__version__
    env["foak"] = foak.__version__
    env["foak_commit"] = git_commit()
    return env


def gpu_tag(gpu_name: str | None) -> str:
    """A short tag for result file names: 'h200', 'h100', 'a100', 'gpu' (another GPU) or 'cpu' (``None`` or
    'cpu', as :func:`environment` records a machine without one)."""
    name = str(gpu_name).lower()
    if gpu_name is None or name == "cpu":
        return "cpu"
    return next((tag for tag in ("h200", "h100", "a100") if tag in name), "gpu")


# ---- correctness checks of the benchmark scripts --------------------------------------------------------
class CheckLog(list):
    """The records of a script's checks, one ``{"check": name, "ok": bool, **numbers}`` dict each (a list, so
    that it is written to the result JSON as it is)."""

    def check(self, name: str, ok, **numbers) -> bool:
        """Record one check and print ``PASS|FAIL name numbers``; returns ``bool(ok)``."""
        self.append({"check": name, "ok": bool(ok), **numbers})
        print(f"{'PASS' if ok else 'FAIL'} {name} {numbers if numbers else ''}", flush=True)
        return bool(ok)

    @property
    def all_ok(self) -> bool:
        return all(c["ok"] for c in self)

    def summary(self) -> str:
        return f"{sum(c['ok'] for c in self)} of {len(self)} checks passed"


def overridden(settings: dict, changes: dict, fn):
    """``fn()`` with ``settings`` updated by ``changes`` while it runs; afterwards ``settings`` holds exactly
    what it held before (also when fn raises)."""
    old = dict(settings)
    settings.update(changes)
    try:
        return fn()
    finally:
        settings.clear()
        settings.update(old)


# ---- CPU smoke runs of the benchmark scripts --------------------------------------------------------------
def install_interpreter_compat() -> None:
    """For the ``--cpu-smoke`` modes of ``benchmarks/*.py``: install the test suite's fixes of Triton's CPU
    interpreter (bf16 rounding, bf16 ``tl.dot``; ``tests/triton_interpreter_compat.py`` of a source checkout),
    loaded from its file, not through sys.path."""
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "tests" / "triton_interpreter_compat.py"
    if not path.is_file():
        raise ValueError(f"the CPU smoke modes need foak's source checkout ({path} is missing)")
    spec = importlib.util.spec_from_file_location("triton_interpreter_compat", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()
