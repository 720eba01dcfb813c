"""QLoRA under bf16 autocast (``foak train --peft qlora-nf4 --bf16``: bf16 NF4 base with a bf16 compute dtype,
``prepare_model_for_kbit_training``'s fp32 norms, embeddings and head, fp32 adapters) computes what PEFT +
bitsandbytes compute: the same dtypes at every projection (bitsandbytes' Linear4bit returns its input's
dtype, so q/k/v and the MLP intermediates are fp32 there, o_proj bf16), and the same values.

The reference is the unpatched PEFT model. Its dequantization is bitsandbytes' CPU kernel, which is wrong on
AVX-512 CPUs when a row is not a whole number of 64-element blocks; here every in_features is a multiple of
64 (hidden 64, intermediate 128), where it is right, and the test checks that it equals foak's NF4
dequantization before comparing anything.

Bound: every adapter gradient within 1e-3 relative of PEFT's (bit-identical today on both backends).
The old code, which cast a QLoRA block's fp32 input to bf16 once for all its projections and summed base
and adapter in bf16, had q/k/v and gate/up outputs in bf16 and was 2.3e-2 (reference ops, every switch) and
3.1e-2 (Triton kernels) away at the worst adapter gradient, while PEFT's own autocast run is 2.1e-2 away
from an fp32 computation of the same quantized model: one rounding more or less anywhere in a block moves
the gradients of this tiny random model by ~1e-2, so 1e-3 fails on any such difference and leaves room only
for rare bf16 rounding flips from fp32-level differences between foak's kernels and torch's.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_lora_rules import ATTENTION, MLP, calls, loss_and_grads

import foak
from foak.ops.nf4 import NF4Weight
from foak.testing import relative_error

LAYERS = 2
GRAD_TOL = 1e-3
F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture
def auto_backend():
    yield
    foak.set_backend("auto")


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=301, max_position_embeddings=64, attention_bias=True,
                         mlp_bias=True)
    path = tmp_path_factory.mktemp("tiny_llama_128")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def qlora_llama(path, kbit: bool = True):
    """What ``foak train --peft qlora-nf4 --bf16`` builds (biases on every projection, scaling 12 / 8 = 1.5)."""
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=BF16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=BF16, quantization_config=quant)
    if kbit:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = LoraConfig(r=8, lora_alpha=12, target_modules=ATTENTION + MLP, init_lora_weights=False)
    torch.manual_seed(1)
    # training mode: in eval mode bitsandbytes repacks the weights for a CPU inference kernel
    return get_peft_model(model, config).train()


def nf4_weight(state, packed) -> NF4Weight:
    return NF4Weight(packed.view(torch.uint8), state.absmax, tuple(state.shape), state.dtype, code=state.code,
                     nested_absmax=state.state2.absmax, nested_code=state.state2.code, offset=state.offset)


def assert_bnb_dequantizes_right(model):
    import bitsandbytes.functional as bnbf

    foak.set_backend("reference")
    try:
        for name, m in model.named_modules():
            state = getattr(getattr(m, "weight", None), "quant_state", None)
            if state is not None:
                ours = nf4_weight(state, m.weight.data).dequantize(state.dtype)
                assert torch.equal(bnbf.dequantize_4bit(m.weight.data, state), ours), name
    finally:
        foak.set_backend("auto")


@contextlib.contextmanager
def recorded_dtypes(model, monkeypatch):
    """{(layer, what): (input dtype, output dtype)} of every projection and MLP. foak's fused MLP block does
    not call its projections: its ops (foak.patching.peft.lora_linears for gate/up, lora_glu_linear for
    down) report theirs; lora_glu_linear forms act(g) * u in g's dtype (test_ops_... below checks its value)."""
    import foak.patching.peft as fused

    seen, current, handles = {}, [None], []

    def record(key):
        return lambda module, args, out: seen.__setitem__(key, (args[0].dtype, out.dtype))

    for i, layer in enumerate(model.base_model.model.model.layers):
        for name in ATTENTION:
            handles.append(getattr(layer.self_attn, name).register_forward_hook(record((i, name))))
        for name in MLP:
            handles.append(getattr(layer.mlp, name).register_forward_hook(record((i, name))))
        handles.append(layer.mlp.register_forward_hook(record((i, "mlp"))))
        handles.append(layer.mlp.register_forward_pre_hook(lambda module, args, i=i: current.__setitem__(0, i)))
    lora_linears, lora_glu_linear = fused.lora_linears, fused.lora_glu_linear

    def recording_linears(x, projections):
        outs = lora_linears(x, projections)
        if len(projections) == 2:  # gate and up (q/k/v: their modules' hooks saw them)
            for name, out in zip(("gate_proj", "up_proj"), outs):
                seen[(current[0], name)] = (x.dtype, out.dtype)
        return outs

    def recording_glu(g, u, *args, **kwargs):
        out = lora_glu_linear(g, u, *args, **kwargs)
        seen[(current[0], "down_proj")] = (g.dtype, out.dtype)
        return out

    monkeypatch.setattr(fused, "lora_linears", recording_linears)
    monkeypatch.setattr(fused, "lora_glu_linear", recording_glu)
    try:
        yield seen
    finally:
        monkeypatch.undo()
        for h in handles:
            h.remove()


# every switch foak has for the model (as foak train) on the torch reference ops; the Triton kernels
# (interpreter: auto) for the rules that touch the QLoRA blocks (RMSNorm and the loss take 3 s more there)
@pytest.mark.parametrize(("backend", "switches"), [
    ("reference", None), ("auto", dict(fused_lora=True, fast_swiglu=True, fast_rope_embeddings=True))])
def test_qlora_under_bf16_autocast_computes_pefts_dtypes_and_values(saved_llama, backend, switches, auto_backend,
                                                                     monkeypatch):
    ref = qlora_llama(saved_llama)
    assert_bnb_dequantizes_right(ref)
    model = copy.deepcopy(ref)
    report = foak.patch(model, **(switches or {}))
    foak.set_backend(backend)
    with torch.autocast("cpu", dtype=BF16):
        with recorded_dtypes(ref, monkeypatch) as peft_dtypes:
            peft_loss, peft_grads = loss_and_grads(ref)
        with recorded_dtypes(model, monkeypatch) as dtypes:
            loss, grads = loss_and_grads(model)
    per_layer = {"q_proj": (F32, F32), "k_proj": (F32, F32), "v_proj": (F32, F32), "o_proj": (BF16, BF16),
                 "gate_proj": (F32, F32), "up_proj": (F32, F32), "down_proj": (F32, F32), "mlp": (F32, F32)}
    assert peft_dtypes == {(i, k): v for i in range(LAYERS) for k, v in per_layer.items()}
    assert dtypes == peft_dtypes
    # every projection ran foak's fused ops: q/k/v and the MLP as blocks
    assert calls(report) == (LAYERS * 7, {}), report.result("llama.fused_lora").notes
    assert f"{LAYERS} forwards as fused LoRA MLP blocks" in report.result("llama.swiglu").notes
    assert f"{LAYERS} forwards with q/k/v as one fused LoRA block" in report.result("llama.fused_lora_qkv").notes
    assert relative_error(loss, peft_loss) <= 1e-6  # the fused loss sums in another order (fp32)
    assert grads.keys() == peft_grads.keys() and len(grads) == LAYERS * 7 * 2
    errors = {name: relative_error(g, peft_grads[name]) for name, g in grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_TOL, f"{worst}: {errors[worst]:.3g}"
    assert all(g.dtype == F32 for g in grads.values())


def test_qlora_of_a_bf16_model_under_autocast_is_pefts(saved_llama, auto_backend):
    """Without prepare_model_for_kbit_training everything is bf16 already: the fused LoRA ops still form
    PEFT's sums (foak's RMSNorm, RoPE and GLU kernels round once where HF's bf16 ops round two or three
    times: their own tests cover that)."""
    ref = qlora_llama(saved_llama, kbit=False)
    model = copy.deepcopy(ref)
    report = foak.patch(model, fused_lora=True)
    foak.set_backend("reference")
    with torch.autocast("cpu", dtype=BF16):
        peft_loss, peft_grads = loss_and_grads(ref)
        loss, grads = loss_and_grads(model)
    assert calls(report) == (LAYERS * 7, {})
    assert relative_error(loss, peft_loss) <= 1e-6
    assert max(relative_error(g, peft_grads[name]) for name, g in grads.items()) <= GRAD_TOL


def test_one_cast_for_the_projections_only_where_it_is_theirs():
    """A block's input is cast once for its projections when each is an nn.Linear or PEFT's lora.Linear
    over one (autocast would cast it the same way); a quantized projection keeps the input's dtype."""
    import bitsandbytes as bnb

    from foak.patching.autocast import cast_for_projections
    from foak.quant import GPTQLinear

    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 32)
    lora_dense = get_peft_model(torch.nn.Sequential(torch.nn.Linear(64, 32)),
                                LoraConfig(r=4, target_modules=["0"])).base_model.model[0]
    nf4 = bnb.nn.Linear4bit(64, 32, compute_dtype=BF16, quant_type="nf4").to("cpu")
    gptq = GPTQLinear.from_linear(torch.nn.Linear(64, 32), group_size=32)
    x = torch.randn(3, 64)
    with torch.autocast("cpu", dtype=BF16):
        assert cast_for_projections(x, [dense, lora_dense]).dtype == BF16
        for quantized in (nf4, gptq):
            assert cast_for_projections(x, [dense, quantized]) is x
        assert cast_for_projections(x, [dense, None]) is x  # a block without the expected projection
        assert cast_for_projections(x.bfloat16(), [nf4]).dtype == BF16
    assert cast_for_projections(x, [dense]) is x  # no autocast


def peft_bnb_formula(x, w, bias, a, b, s):
    """lora.bnb.Linear4bit over Linear4bit under bf16 autocast, written out: the base in bf16 cast back to
    x's dtype, the adapter's output (bf16 GEMMs, then the scaling in bf16) cast to it and added there."""
    base = torch.nn.functional.linear(x.to(BF16), w, bias.to(BF16)).to(x.dtype)
    adapter = torch.nn.functional.linear(torch.nn.functional.linear(x.to(BF16), a.to(BF16)), b.to(BF16)) * s
    return base + adapter.to(x.dtype)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_ops_with_a_quantized_base_under_autocast_form_pefts_sums(backend, auto_backend):
    """foak.lora_linear / lora_linears / lora_glu_linear over an NF4 weight under bf16 autocast, fp32 and bf16
    inputs: the outputs and every gradient equal :func:`peft_bnb_formula` under autograd (the same
    operations); lora_glu_linear's act(g) * u is formed in fp32 from fp32 g, u, then rounded once."""
    import bitsandbytes.functional as bnbf

    foak.set_backend(backend)
    gen = torch.Generator().manual_seed(3)
    packed, state = bnbf.quantize_4bit(torch.randn(40, 64, generator=gen).bfloat16(), blocksize=64,
                                       quant_type="nf4", compress_statistics=True)
    weight = nf4_weight(state, packed)
    dense = weight.dequantize(BF16)
    bias = torch.randn(40, generator=gen)
    a, b = torch.randn(5, 64, generator=gen) * 0.2, torch.randn(40, 5, generator=gen) * 0.2
    dy = torch.randn(2, 3, 40, generator=gen)
    s = 1.5

    def run(fn, *inputs):
        leaves = [t.clone().requires_grad_() for t in inputs]
        with torch.autocast("cpu", dtype=BF16):
            out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, dy.to(out.dtype)))

    for x_dtype in (F32, BF16):  # q/k/v and MLP inputs after prepare_model_for_kbit_training; o_proj's input
        x = torch.randn(2, 3, 64, generator=gen).to(x_dtype)
        expected = run(lambda x, a, b: peft_bnb_formula(x, dense, bias, a, b, s), x, a, b)
        ours = run(lambda x, a, b: foak.lora_linear(x, weight, bias, a, b, s), x, a, b)
        pair = run(lambda x, a, b: foak.lora_linears(x, [(weight, bias, a, b, s, 0.0, None)] * 2)[1], x, a, b)
        assert expected[0].dtype == x_dtype and expected[1].dtype == x_dtype
        for got in (ours, pair):
            for e, o in zip(expected, got):
                assert o.dtype == e.dtype and torch.equal(o, e), (x_dtype, (o - e).abs().max())
        with torch.autocast("cpu", dtype=BF16):  # a quantized and a dense base in one call: each as alone
            quantized, plain = foak.lora_linears(x, [(weight, bias, a, b, s, 0.0, None), (dense.float(), None, a, b, s,
                                                                                        0.0, None)])
            assert torch.equal(quantized, foak.lora_linear(x, weight, bias, a, b, s)) and quantized.dtype == x_dtype
            assert torch.equal(plain, foak.lora_linear(x, dense.float(), None, a, b, s)) and plain.dtype == BF16

    g, u = torch.randn(2, 3, 64, generator=gen), torch.randn(2, 3, 64, generator=gen)
    product = lambda g, u: torch.nn.functional.silu(g) * u  # fp32, as HF's MLP computes it from fp32 g, u
    expected = run(lambda g, u, a, b: peft_bnb_formula(product(g, u), dense, bias, a, b, s), g, u, a, b)
    ours = run(lambda g, u, a, b: foak.lora_glu_linear(g, u, weight, bias, a, b, s), g, u, a, b)
    for e, o in zip(expected, ours):
        assert o.dtype == e.dtype == F32
        assert relative_error(o, e) <= 1e-6, relative_error(o, e)  # the kernel's silu vs torch's: fp32 ulps


def test_ops_with_a_quantized_base_under_autocast_with_dropout_match_their_reference(auto_backend):
    """With dropout (foak's masks, not PEFT's) the Triton path and the torch reference agree exactly: the
    dropout applies to the input cast to the compute dtype, in the forward and where the backward
    regenerates it."""
    import bitsandbytes.functional as bnbf

    gen = torch.Generator().manual_seed(4)
    packed, state = bnbf.quantize_4bit(torch.randn(40, 64, generator=gen).bfloat16(), blocksize=64,
                                       quant_type="nf4", compress_statistics=True)
    weight = nf4_weight(state, packed)
    a, b = torch.randn(5, 64, generator=gen) * 0.2, torch.randn(40, 5, generator=gen) * 0.2
    x, u = torch.randn(2, 3, 64, generator=gen), torch.randn(2, 3, 64, generator=gen)
    dy = torch.randn(2, 3, 40, generator=gen)
    results = []
    for backend in ("auto", "reference"):
        foak.set_backend(backend)
        leaves = [t.clone().requires_grad_() for t in (x, u, a, b)]
        xl, ul, al, bl = leaves
        with torch.autocast("cpu", dtype=BF16):
            q, v = foak.lora_linears(xl, [(weight, None, al, bl, 1.5, 0.3, 11), (weight, None, al, bl, 1.0, 0.0, None)])
            down = foak.lora_glu_linear(xl, ul, weight, None, al, bl, 1.5, dropout_p=0.2, seed=12)
        total = (q * dy).sum() + (v * dy).sum() + (down * dy).sum()
        results.append((q, v, down, *torch.autograd.grad(total, leaves)))
    for what, triton_path, reference in zip(("q", "v", "down", "dx", "du", "dA", "dB"), *results):
        assert triton_path.dtype == F32 and torch.allclose(triton_path, reference, rtol=1e-6, atol=1e-6), (
            what, relative_error(triton_path, reference))
