import importlib
import re

import pytest
import torch

import foak
from foak import backend
from foak.cli import main
from foak.ops.rms_norm import rms_norm_reference
from foak.testing import relative_error


@pytest.fixture
def restore_backend():
    yield
    foak.set_backend("auto")


def test_auto_uses_triton_under_the_interpreter():
    assert backend.interpreter_enabled()
    assert backend.describe(torch.device("cpu")) == "triton-interpreter"


def test_reference_backend_runs_the_reference(restore_backend, monkeypatch):
    calls = []
    module = importlib.import_module("foak.ops.rms_norm")

    monkeypatch.setattr(module, "_forward_launch", lambda *a: calls.append(a))
    foak.set_backend("reference")
    x, w = torch.randn(5, 17), torch.randn(17)
    assert torch.equal(foak.rms_norm(x, w), rms_norm_reference(x, w))
    assert calls == []  # no kernel launched


def test_forced_triton_without_gpu_or_interpreter_is_an_error(restore_backend, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backend.describe(torch.device("cpu")) == "reference"
    foak.set_backend("triton")
    with pytest.raises(ValueError, match="needs a CUDA device or TRITON_INTERPRET=1"):
        foak.rms_norm(torch.randn(3, 8), torch.randn(8))


@pytest.mark.parametrize(
    "name", ["rms_norm", "rope", "glu_linear", "lora_glu_linear", "cross_entropy", "linear_cross_entropy",
             "activations", "lora", "nf4", "gptq", "gptq_matmul", "moe", "moe_router", "varlen_attention"])
def test_foak_ops_names_are_the_modules_and_top_level_names_the_functions(name):
    import types

    import foak.ops

    module = importlib.import_module(f"foak.ops.{name}")
    assert isinstance(module, types.ModuleType)
    assert getattr(foak.ops, name) is module
    if name in foak.__all__:
        assert callable(getattr(foak, name)) and getattr(foak, name) is getattr(module, name)


def test_unknown_backend_names_are_errors(monkeypatch):
    with pytest.raises(ValueError, match="unknown foak backend 'cuda'"):
        foak.set_backend("cuda")
    monkeypatch.setenv("FOAK_BACKEND", "fast")
    with pytest.raises(ValueError, match="FOAK_BACKEND='fast' is not valid"):
        backend.get_backend()


def _opcheck_cases():
    x, w, r = torch.randn(5, 33), torch.randn(33), torch.randn(5, 33)
    rstd = torch.randn(5).abs() + 0.5
    q, k = torch.randn(2, 3, 7, 16), torch.randn(2, 1, 7, 16)
    cos, sin = torch.rand(1, 7, 12), torch.rand(1, 7, 12)
    g, u = torch.randn(6, 19), torch.randn(6, 19)
    logits, target = torch.randn(7, 301), torch.tensor([3, -100, 0, 300, 17, -100, 5])
    hidden, head = torch.randn(7, 13), torch.randn(301, 13)
    lce_key = repr((-100, 0.0, 0.0, 1.0, None))
    ops = torch.ops.foak
    return [
        (ops.rms_norm_forward, (x, w, None, 1e-6, "llama")),
        (ops.rms_norm_forward, (x, w, r, 1e-6, "gemma")),
        (ops.rms_norm_backward, (torch.randn(5, 33), x, w, rstd, None, "llama")),
        (ops.rms_norm_backward, (torch.randn(5, 33), x, w, rstd, torch.randn(5, 33), "gemma")),
        (ops.rope, (q, k, cos, sin, None, False)),
        (ops.rope, (q, k, torch.rand(9, 12), torch.rand(9, 12), torch.tensor([[0, 1, 2, 0, 1, 2, 3]]), True)),
        (ops.glu_forward, (g, u, "silu")),
        (ops.glu_backward, (torch.randn(6, 19), g, u, "gelu")),
        (ops.cross_entropy_forward, (logits, target, torch.tensor(0.2), None, -100, 0.1, 1e-3, 2.0, 5.0, True, True)),
        (ops.cross_entropy_forward, (logits, target, torch.tensor(1.0), torch.rand(301), -100, 0.0, 0.0, 1.0, None,
                                     False, False)),
        (ops.cross_entropy_backward, (torch.randn(7), logits, target, torch.randn(2, 7), None, -100, 0.0, 0.0, 1.0,
                                      None)),
        (ops.cross_entropy_backward, (torch.tensor(0.3), logits.half(), target, torch.randn(2, 7), torch.rand(301),
                                      -100, 0.1, 0.0, 1.0, None)),
        (ops.linear_cross_entropy_forward, (hidden, head, None, target, torch.tensor(0.5), None, lce_key, True, True,
                                            False, True, False)),
        (ops.linear_cross_entropy_forward, (hidden.half(), head, None, target, torch.tensor(0.5), torch.rand(301),
                                            lce_key, True, True, False, False, True)),
        (ops.linear_cross_entropy_backward, (torch.randn(7), hidden, head, torch.randn(301), target,
                                             torch.randn(2, 7), None, lce_key, True, False, True, False)),
        *_moe_and_packed_attention_cases(),
    ]


def _moe_and_packed_attention_cases():
    import foak.ops.moe  # noqa: F401  (registers the ops)
    import foak.ops.varlen_attention  # noqa: F401

    ops = torch.ops.foak
    y, pos, w = torch.randn(6, 10), torch.tensor([[0, 3], [1, 5], [2, 4]]), torch.rand(3, 2)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)  # 3 experts: 2, 0 and 4 rows
    h, da = torch.randn(6, 8), torch.randn(6, 4)
    q, kv = torch.randn(8, 4, 16), torch.randn(8, 2, 16)
    positions = torch.tensor([[0, 1, 2, 0], [0, 1, 2, 3]])  # 2 rows of 4: sequences of 3, 1 and 4 tokens
    return [
        (ops.moe_combine, (y, pos, w, torch.float32)),
        (ops.moe_combine, (y, pos, None, torch.float64)),
        (ops.moe_combine_backward, (torch.randn(3, 10), y, pos, w)),
        (ops.moe_grouped_mm, (y, torch.randn(3, 10, 7), offs)),
        (ops.moe_grouped_mm_weight, (y, torch.randn(6, 7), offs, 3)),
        (ops.moe_glu_backward, (da, h, "silu")),
        (ops.varlen_attention, (q, kv, kv.clone(), positions, None, 3, "sdpa")),
        (ops.varlen_attention_backward, (torch.randn(8, 4, 16), q, kv, kv.clone(), positions, 0.3, None, "sdpa")),
    ]


@pytest.mark.parametrize("op, args", _opcheck_cases(), ids=lambda v: str(v) if not isinstance(v, tuple) else "")
def test_custom_ops_pass_opcheck(op, args):
    # fake (meta) implementations, schemas and mutation declarations agree with the real kernels
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_torch_compile_fullgraph_traces_through_all_ops():
    def block(x, w, r, q, k, cos, sin, g, u):
        y, s = foak.rms_norm(x, w, residual=r)
        q2, k2 = foak.rope(q, k, cos, sin)
        h = foak.swiglu(g * y.sum(), u)
        return y.sum() + s.square().sum() + q2.square().sum() + k2.sum() + h.sum()

    inputs = [torch.randn(5, 33), torch.randn(33), torch.randn(5, 33), torch.randn(2, 3, 7, 16),
              torch.randn(2, 1, 7, 16), torch.rand(1, 7, 16), torch.rand(1, 7, 16), torch.randn(4, 21),
              torch.randn(4, 21)]
    grad_idx = [0, 1, 2, 3, 4, 7, 8]

    def run(fn):
        leaves = [t.clone().requires_grad_(i in grad_idx) for i, t in enumerate(inputs)]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, [leaves[i] for i in grad_idx])
        return out, grads

    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=recording_backend)  # fullgraph: a break raises
    out_c, grads_c = run(compiled)
    # the traced graph holds foak's custom ops (forward and backward), not inlined launcher code
    traced = "\n".join(graphs)
    for op in ("rms_norm_forward", "rms_norm_backward", "rope", "glu_forward", "glu_backward"):
        assert f"torch.ops.foak.{op}" in traced, op
    out_e, grads_e = run(block)
    assert relative_error(out_c, out_e) < 1e-6
    for gc, ge in zip(grads_c, grads_e):
        assert relative_error(gc, ge) < 1e-6


def test_torch_compile_fullgraph_traces_through_the_losses():
    from foak.ops.cross_entropy import cross_entropy
    from foak.ops.linear_cross_entropy import linear_cross_entropy

    def losses(logits, hidden, head, target):
        ce = cross_entropy(logits, target, label_smoothing=0.1, check_targets=False)
        rows = cross_entropy(logits * 2.0, target, reduction="none", check_targets=False)
        return ce + rows.square().sum() + linear_cross_entropy(hidden, head, target, lse_square_scale=1e-3)

    torch.manual_seed(0)
    inputs = [torch.randn(9, 301), torch.randn(9, 13), torch.randn(301, 13) * 0.3]
    target = torch.tensor([3, -100, 0, 300, 17, -100, 5, 8, 9])

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves, target)
        return out, torch.autograd.grad(out, leaves)

    torch._dynamo.reset()
    # check_targets=False: the range check's host sync is a graph break; linear_cross_entropy's own check
    # is skipped while compiling (its custom op validates nothing it could not trace)
    out_c, grads_c = run(torch.compile(losses, fullgraph=True, backend="aot_eager"))
    out_e, grads_e = run(losses)
    assert relative_error(out_c, out_e) < 1e-6
    for gc, ge in zip(grads_c, grads_e):
        assert relative_error(gc, ge) < 1e-6


def test_cli_verify_ops_passes_and_prints_a_table(capsys):
    assert main(["verify", "--ops"]) == 0
    out = capsys.readouterr().out
    assert "backend: triton-interpreter" in out
    for op in ("rms_norm", "rope", "glu", "glu_linear", "cross_entropy", "linear_cross_entropy", "linear_log_probs",
               "linear_jsd", "lowrank"):
        assert f"| {op}" in out
    assert "not run by --ops (foak verify without --ops checks them in the model rows of): lora, lora_glu_linear " \
        "(fused_lora); moe, moe_router (fast_moe)" in out
    from foak.testing import self_check_cases

    n = 2 * len(self_check_cases())  # fp32 and bf16
    assert n >= 30 and "FAIL" not in out and f"self-check: {n} of {n} cases within tolerance" in out


def test_verify_ops_runs_or_names_every_op():
    # before: "--ops: every op vs its reference" ran 6 of foak.ops' 17 ops and named none of the others
    import pkgutil

    import foak.ops
    from foak.testing import OPS_NOT_SELF_CHECKED, self_check_cases

    ops = {m.name for m in pkgutil.iter_modules(foak.ops.__path__) if not m.name.startswith("_")}
    run = {{"glu": "activations"}.get(c.op, c.op) for c in self_check_cases()}  # (glu lives in ops/activations.py)
    assert run.isdisjoint(OPS_NOT_SELF_CHECKED) and run | set(OPS_NOT_SELF_CHECKED) == ops, (
        sorted(ops - run - set(OPS_NOT_SELF_CHECKED)))


def test_cli_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "triton-interpreter" in out


def test_cli_verify_model_checks_every_rule_of_the_model(capsys):
    # the default run on the tiny Llama: each switch alone (fused_lora on a LoRA copy, packed attention on a
    # packed batch), then together (full fine-tuning on the padded batch; with fused_lora, on the packed one).
    # The per-rule checks (bf16, MoE, call counts, skips) are tests/test_verify.py's, on one rule each
    assert main(["verify", "--arch", "llama"]) == 0
    out = capsys.readouterr().out
    assert "tiny llama" in out and "FAIL" not in out and "not checked" not in out
    rows = [line.split("  ")[0] for line in out.splitlines()[2:13]]
    assert rows == ["fused_linear_loss", "loss", "offload_activations", "rms_norm", "rope", "swiglu", "tiled_mlp", "packed_attention",
                    "all: fused_linear_loss, packed_attention, rms_norm, rope, swiglu, tiled_mlp", "lora",
                    "all: lora, fused_linear_loss, packed_attention, rms_norm, rope, swiglu, tiled_mlp"], out
    # the fused paths ran, none fell back (tiled_mlp's chunks call the MLP's LoRA layers once per chunk)
    assert re.search(r"lora (\d+)/\1; packed_attention 2/2", out), out
    assert "tiled_mlp: 2 forwards tiled" in out
    assert "no rule for this architecture: fast_moe" in out
    assert "offload_activations 2/2" in out  # 2 of 2 checkpointed layers' inputs offloaded
    assert out.splitlines()[-1] == "verify: PASS: 11 of 11 checks passed"
