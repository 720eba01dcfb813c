"""The process of one ``foak bench`` experiment: ``python -m foak.bench.worker EXPERIMENT.json RESULT.json``
(under ``torchrun`` for several GPUs: rank 0 writes the result).

The result file always gets written when Python is still alive to do it: status "ok" with the measurements,
"oom" for an out-of-memory error, "failed" for any other exception (its type, message and the last frame;
the traceback goes to stderr, i.e. the experiment's log). A process killed from outside (the OOM killer, a
segfault) writes nothing: the runner records that from the exit status."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def _error_text(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    tb = traceback.extract_tb(e.__traceback__)
    if tb:
        frame = tb[-1]
        text += f" (at {Path(frame.filename).name}:{frame.lineno} in {frame.name})"
    return text


def _is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(e).lower()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m foak.bench.worker EXPERIMENT.json RESULT.json", file=sys.stderr)
        return 2
    exp = json.loads(Path(argv[0]).read_text())
    result_path = Path(argv[1])
    rank = int(os.environ.get("RANK", "0"))
    print(f"foak bench worker: {exp['experiment']} (rank {rank}, pid {os.getpid()})", flush=True)
    try:
        from foak.bench.step import run_experiment

        result = run_experiment(exp)
        code = 0
    except BaseException as e:  # noqa: BLE001 (every failure becomes a result row)
        traceback.print_exc()
        if isinstance(e, KeyboardInterrupt):
            raise
        result = {"status": "oom" if _is_oom(e) else "failed", "error": _error_text(e)}
        code = 1
    if rank == 0:
        result_path.write_text(json.dumps(result, default=str))
    if result.get("patch_report"):
        print(result["patch_report"], flush=True)
    print(f"foak bench worker: {result['status']}" + (f": {result['error']}" if result.get("error") else ""),
          flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
