"""Running a function on N CPU processes joined by a gloo process group, robustly enough for CI.

- forkserver: the ranks fork from a fresh server that imported torch (and whatever ``preload`` names) once; a
  plain fork of the test process would inherit its autograd and OpenMP threads' state, spawn would import
  everything once per rank;
- a file store (no TCP port to collide with another test run on the machine);
- one deadline for the whole run: a rank still alive after it is killed and the test fails with every rank's
  traceback, instead of CI hanging.

``run_ranks(fn, world, tmp_dir)`` calls ``fn(rank, world)`` in each rank after ``init_process_group`` (and
destroys the group after it); each rank's return value is saved with ``torch.save`` and returned in rank order.
``fn`` must be importable by name (a module-level function of a test module)."""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path


def _rank_entry(fn, rank: int, world: int, store: str, result_path: str) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        try:
            result = fn(rank, world)
        finally:
            dist.destroy_process_group()
        torch.save(result, result_path)
    except BaseException:
        with open(result_path + ".err", "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(fn, world: int, tmp_dir, timeout_s: float = 120, preload=("torch", "torch.distributed.fsdp")):
    import torch

    tmp = Path(tmp_dir)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload) + [fn.__module__])
    paths = [str(tmp / f"rank{r}.pt") for r in range(world)]
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world, str(tmp / "store"), paths[r]), daemon=True)
             for r in range(world)]
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    errors = {r: open(p + ".err").read() for r, p in enumerate(paths) if os.path.exists(p + ".err")}
    assert not hung, f"ranks {hung} did not finish within {timeout_s} s; errors: {errors}"
    assert all(p.exitcode == 0 for p in procs) and not errors, \
        f"exit codes {[p.exitcode for p in procs]}; errors: {errors}"
    return [torch.load(p, weights_only=False) for p in paths]
