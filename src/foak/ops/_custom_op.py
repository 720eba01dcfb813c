"""Registering an op's launcher as a torch.library custom op (so torch.compile traces through it)."""

from __future__ import annotations

import contextlib
import functools

import torch


def custom_op(name: str, fake, mutates_args=()):
    """Register ``impl`` as ``torch.ops.foak.<name>`` with the ``fake`` (meta) implementation.

    The returned callable runs the registered op while torch.compile traces, and ``impl`` directly in
    eager mode: the dispatcher's per-call host cost (0.1-0.25 ms per call measured on the H200 machine,
    more than some of these kernels take on the GPU) buys nothing outside compilation.
    """

    def decorate(impl):
        op = torch.library.custom_op(f"foak::{name}", impl, mutates_args=mutates_args)
        op.register_fake(fake)

        @functools.wraps(impl)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return impl(*args, **kwargs)

        call.custom_op = op
        return call

    return decorate


_AUTOGRAD_KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView")


@contextlib.contextmanager
def autograd_inside_op():
    """Grad mode with autograd dispatch back on, inside a custom op's implementation (the dispatcher runs it
    below the autograd keys, where ``torch.enable_grad()`` alone records nothing): for a backward op that
    recomputes its forward under autograd. Outside the dispatcher (eager calls of the implementation) it
    changes nothing but grad mode."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for name in _AUTOGRAD_KEYS:
        exclude = exclude.remove(getattr(C.DispatchKey, name))
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield
