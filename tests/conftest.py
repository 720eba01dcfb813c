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


@pytest.fixture(autouse=True)
def _seed():
    # finalizers of the previous tests' patched models (they release foak's RoPE global) run now, not in
    # the middle of this test: a release during a torch.compile trace broke dynamo's guard on the global
    gc.collect()
    torch.manual_seed(1234)


def assert_case(case, dtype):
    """Run a foak.testing.Case and assert every output and gradient is within the dtype's budget."""
    errors = case.run(dtype)
    tol = TOLERANCE[dtype]
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"{case.op} {case.name} {dtype}: errors over {tol}: {bad} (all: {errors})"
    return errors
