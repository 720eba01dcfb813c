import gc
import os

# Triton reads this when @triton.jit decorates a kernel, so it must be set before foak is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from foak.backend import interpreter_enabled
from foak.testing import TOLERANCE

if interpreter_enabled():
    import triton_interpreter_compat

    triton_interpreter_compat.install()


# modules whose tests run torch.compile (a full garbage collection per test elsewhere cost minutes of CI)
_COMPILING_MODULES = ("test_compile_model", "test_recompute", "test_dispatch_and_compile", "test_lora_op")


@pytest.fixture(autouse=True)
def _seed(request):
    if request.module.__name__.rsplit(".", 1)[-1] in _COMPILING_MODULES:
        # finalizers of earlier tests' patched models (they release foak's RoPE global) run now, not in the
        # middle of a torch.compile trace, where a release broke dynamo's guard on the global
        gc.collect()
    torch.manual_seed(1234)


def assert_case(case, dtype):
    """Run a foak.testing.Case and assert every output and gradient is within the dtype's budget."""
    errors = case.run(dtype)
    tol = TOLERANCE[dtype]
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"{case.op} {case.name} {dtype}: errors over {tol}: {bad} (all: {errors})"
    return errors


@pytest.fixture
def reference_ops():
    """foak's torch reference ops for one test (``foak.set_backend("reference")``, reset to "auto" after it):
    for option matrices and patcher logic whose kernels other cases run in the interpreter."""
    import foak

    foak.set_backend("reference")
    yield
    foak.set_backend("auto")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_per_xdist_worker():
    """Under pytest-xdist (the README's ``-n 2`` on two cores) each worker is one process per core: torch's
    intra-op threads would make 2 x 2 threads spin against each other (measured: ~10% more CPU, up to 20% more
    wall time for two files run side by side on 2 cores). A plain pytest run keeps torch's default."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    yield
