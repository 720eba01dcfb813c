"""torch.compile(fullgraph=True) of whole patched models: the default config (``foak.patch(model)``) of dense
and MoE architectures on padded and packed batches, and the fast_loss configuration.

fullgraph=True turns any graph break into an error; the graph-break counter is checked as well. The
compiled model (backend aot_eager: forward and backward graphs, run eagerly, so the comparison is about
what dynamo traced, not about a code generator's numerics) must give the loss and every parameter
gradient of the eager patched model and of the unpatched model to 1e-5 relative (fp32).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import foak
from foak.models.tiny import tiny_model
from foak.patching import replacements
from foak.testing import relative_error

KERNELS = dict(fast_rms_layernorm=True, fast_rope_embeddings=True, fast_swiglu=True)
# the custom ops each configuration must have traced (forward and backward graphs together); the loss
# ops may compute their gradient in the forward or in the backward, so only their forward is required
OPS = {"fast_loss": ("rms_norm_forward", "rms_norm_backward", "rope", "glu_forward", "glu_backward_and_output",
                     "cross_entropy_forward")}


def _step(run, model, ids):
    model.zero_grad(set_to_none=True)
    loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _compile(model):
    graphs = []

    def recording_aot_eager(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def keep(g, _):
            graphs.append(g.print_readable(print_output=False))
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, example_inputs)

    return torch.compile(model, backend=recording_aot_eager, fullgraph=True), graphs


def test_whole_patched_model_compiles_without_graph_breaks(loss_switch="fast_loss"):
    # (fused_linear_loss: the default config's test below)
    model, ref = tiny_model("llama"), tiny_model("llama")
    model.train(), ref.train()
    foak.patch(model, **KERNELS, **{loss_switch: True})
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch._dynamo.reset()
    counters.clear()
    compiled, graphs = _compile(model)
    try:
        loss_c, grads_c = _step(compiled, model, ids)
        assert dict(counters["graph_break"]) == {}
        assert len([g for g in graphs if "torch.ops.foak.rope" in g]) == 2  # one forward, one backward graph
        traced = "\n".join(graphs)
        for op in OPS[loss_switch]:
            assert f"torch.ops.foak.{op}." in traced, op
        loss_c2, grads_c2 = _step(compiled, model, ids)  # a second step runs the cached graphs
        assert len(graphs) == 2, "recompiled"
        loss_e, grads_e = _step(model, model, ids)  # eager patched, after compiling: the flags were reset
        loss_r, grads_r = _step(ref, ref, ids)
    finally:
        foak.restore(model)
    assert replacements._ROPE_ACTIVE.on is False
    assert torch.equal(loss_c, loss_c2)
    for reference, what in ((loss_e, "eager patched"), (loss_r, "unpatched")):
        assert relative_error(loss_c, reference) < 1e-5, what
    for name in grads_r:
        assert relative_error(grads_c[name], grads_e[name]) < 1e-5, f"{name} vs eager patched"
        assert relative_error(grads_c[name], grads_r[name]) < 1e-5, f"{name} vs unpatched"
        assert torch.equal(grads_c[name], grads_c2[name]), name


def test_an_unpatched_model_compiled_beside_a_patched_one_keeps_hf_rope():
    # the RoPE dispatcher is a module global shared by every Llama: compiled, an unpatched model must
    # still trace HF's rotary embedding, and the patched one foak's
    patched, plain = tiny_model("llama"), tiny_model("llama")
    foak.patch(patched, **KERNELS, fused_linear_loss=True)
    ids = torch.randint(0, patched.config.vocab_size, (1, 7))
    try:
        torch._dynamo.reset()
        compiled_plain, graphs_plain = _compile(plain)
        compiled_patched, graphs_patched = _compile(patched)
        loss_plain = compiled_plain(input_ids=ids, labels=ids).loss
        loss_patched = compiled_patched(input_ids=ids, labels=ids).loss
        assert not any("torch.ops.foak" in g for g in graphs_plain)
        assert any("torch.ops.foak.rope." in g for g in graphs_patched)
        assert relative_error(loss_patched, loss_plain) < 1e-5
    finally:
        foak.restore(patched)


# ---- the default config -----------------------------------------------------------------------------

_COMMON_OPS = ("rms_norm_forward", "rms_norm_backward", "rope", "linear_cross_entropy_forward")
_GLU_OPS = ("glu_forward", "glu_backward_and_output")  # the dense SwiGLU MLPs
# the MoE experts: the grouped GEMMs (the per-expert loop, on the CPU), the GLU, the combine, fwd and bwd
_MOE_OPS = ("glu_forward", "moe_grouped_mm", "moe_combine", "moe_combine_backward", "moe_glu_backward",
            "moe_grouped_mm_weight")
_PACKED_OPS = ("varlen_attention", "varlen_attention_backward")


def _batch(kind, vocab):
    """Two rows of 10 tokens: "padded" (left padding in row 0, an attention mask, pads ignored by the loss) or
    "packed" (position ids restarting inside the rows, no mask; a sequence of 9 is longer than Mistral's
    window of 8)."""
    ids = torch.randint(0, vocab, (2, 10))
    if kind == "padded":
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2], [*range(9), 0]])
    return dict(input_ids=ids, position_ids=positions, labels=ids)


def _train_step(run, model, batch):
    model.zero_grad(set_to_none=True)
    # use_cache=False: transformers looks for packed sequences only without a cache (the unpatched reference)
    loss = run(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# Mistral is Llama's decoder plus a sliding window (passed into the packed attention op); Qwen3-MoE holds
# Qwen3's attention (q/k norms), a dense SwiGLU layer and an MoE layer. Each batch kind is one more compile.
@pytest.mark.parametrize("arch, kinds", [("mistral", ("padded", "packed")), ("qwen3_moe", ("packed",))])
def test_default_config_compiles_fullgraph_and_matches_eager(arch, kinds):
    model, ref = tiny_model(arch), tiny_model(arch)
    model.train(), ref.train()
    report = foak.patch(model)  # the default config: every switch foak has for the architecture
    switches = {r.switch for r in report.results if r.modules}
    moe = arch in ("qwen3_moe", "mixtral")
    assert {"rms_norm", "rope", "fused_linear_loss", "packed_attention"} <= switches
    assert ("moe" in switches) == moe
    batches = {kind: _batch(kind, model.config.vocab_size) for kind in kinds}
    try:
        if moe:
            # transformers installs its output-capturing hooks (router logits) at a model's first forward,
            # under a lock dynamo cannot trace: the unpatched model's own graph break. One eager forward first.
            with torch.no_grad():
                model(input_ids=batches[kinds[0]]["input_ids"][:1, :2])
        torch._dynamo.reset()
        counters.clear()
        compiled, graphs = _compile(model)
        for kind, batch in batches.items():
            before = len(graphs)
            loss_c, grads_c = _train_step(compiled, model, batch)
            assert dict(counters["graph_break"]) == {}, kind
            assert len(graphs) == before + 2, kind  # one forward and one backward graph per batch kind
            traced = "\n".join(graphs[before:])
            expected = _COMMON_OPS + (_MOE_OPS if moe else ()) + (_GLU_OPS if arch != "mixtral" else ())
            expected += _PACKED_OPS if kind == "packed" else ()
            for op in expected:
                assert f"torch.ops.foak.{op}." in traced, (kind, op)
            if kind == "padded":  # an attention mask: transformers' sdpa with its mask, as in eager
                assert "torch.ops.foak.varlen_attention" not in traced
            # the unpatched model in eager mode (foak's eager path equals it: tests/test_packing.py, test_moe_models.py)
            loss_r, grads_r = _train_step(ref, ref, batch)
            assert relative_error(loss_c, loss_r) < 1e-5, kind
            assert grads_c.keys() == grads_r.keys()
            for name in grads_r:
                assert relative_error(grads_c[name], grads_r[name]) < 1e-5, (kind, name)
    finally:
        foak.restore(model)


@pytest.mark.parametrize("base, eager_first", [("nf4", True), ("gptq", True), ("gptq", False)])
def test_a_fused_lora_layer_over_a_quantized_base_compiles(base, eager_first, tmp_path):
    # the caches of the quantized weights (filled by an eager call; GPTQ's at patch time) are read without
    # their data pointers and storages while dynamo traces (comparing those was a graph break); a GPTQ weight
    # built inside the trace would read g_idx on the host
    if base == "nf4":
        from test_lora_nf4_rules import qlora_llama

        torch.manual_seed(0)
        tiny_model("llama").save_pretrained(tmp_path)
        model = qlora_llama(tmp_path, torch.float32, torch.float32, targets=["down_proj"])
    else:
        from test_lora_gptq_rules import gptq_lora

        from foak.quant import quantize_model_gptq, save_gptq

        torch.manual_seed(0)
        save_gptq(quantize_model_gptq(tiny_model("llama"), group_size=32), tmp_path)
        model = gptq_lora(tmp_path, torch.float32, targets=["down_proj"])
        if not eager_first:  # as after a move to another device: the weight objects load_gptq built are stale
            for module in model.modules():
                if hasattr(module, "_weight_cache"):
                    module._weight_cache = None
    report = foak.patch(model, fused_lora=True)
    assert report.result("llama.fused_lora").modules == 2
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    x = torch.randn(2, 5, layer.in_features)

    def run(fn):
        xs = x.clone().requires_grad_()
        out = fn(xs)
        params = [p for p in layer.parameters() if p.requires_grad]
        return (out, *torch.autograd.grad(out.square().sum(), [xs, *params]))

    try:
        eager = run(layer) if eager_first else None
        torch._dynamo.reset()
        counters.clear()
        compiled, graphs = _compile(layer)
        traced = run(compiled)
        assert dict(counters["graph_break"]) == {}
        eager = eager or run(layer)
        assert "torch.ops.foak." + ("nf4_dequantize" if base == "nf4" else "gptq_") in "\n".join(graphs)
    finally:
        foak.restore(model)
    assert len(eager) == 4  # out, dx, dA, dB
    for e, c in zip(eager, traced):
        assert relative_error(c, e) < 1e-5
