"""GPTQLinear storage: FSDP2 (fully_shard + MixedPrecisionPolicy bf16/fp32) shards the packed tensors and
all-gathers them bit-exactly, on CPU with two gloo processes; the state dict / checkpoint format is the GPTQ
one; model.to(dtype) and PEFT's prepare_model_for_kbit_training leave the weight's bits alone.

The packed words include ones whose 16-bit halves (and whole 32 bits) are NaN and subnormal bit patterns of
bf16 / fp16 / fp32: a float view of packed integers under a mixed-precision cast would canonicalise them."""

import copy

import pytest
import torch
import torch.nn.functional as F
from distributed_utils import run_ranks
from torch import nn

from foak.ops.gptq import gptq_dequantize_reference
from foak.quant import GPTQLinear, load_gptq, quantize_model_gptq, save_gptq
from foak.quant.gptq import SCALES_BITS

WORLD = 2
TIMEOUT_S = 120  # the whole two-process run; a hang fails the test instead of blocking CI
PACKED = ("qweight", "qzeros", "scales", "g_idx")

# 16-bit halves: fp16 signalling / quiet NaNs (with payloads), bf16 signalling / quiet NaNs, -NaN, all-ones,
# fp16 / bf16 smallest and largest subnormals, -0 and the smallest negative subnormal
HALVES = [0x7C01, 0x7E01, 0xFC01, 0x7F81, 0x7FC1, 0xFF81, 0xFFFF, 0x0001, 0x03FF, 0x007F, 0x8000, 0x8001]
# whole words: fp32 signalling / quiet NaN with payload, -NaN, smallest subnormal, -0
WORDS = [0x7F800001, 0x7FC00001, 0xFF800001, 0x00000001, 0x80000000]


def _int32(values):
    v = torch.tensor(values, dtype=torch.int64)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _special_words():
    halves = [(hi << 16) | lo for hi in HALVES for lo in HALVES[::-1]][:64]
    return _int32(halves + WORDS)


def _fill_special(t, gen):
    """Random int32 words, the special ones first."""
    words = torch.randint(-2**31, 2**31, t.shape, dtype=torch.int64, generator=gen).to(torch.int32).flatten()
    special = _special_words()
    words[:min(len(special), words.numel())] = special[:words.numel()]
    return words.reshape(t.shape)


def _special_scales(shape, dtype, gen):
    """Positive scales around 1e-2 with the dtype's smallest and largest subnormal among them."""
    s = (torch.rand(shape, generator=gen) * 0.02 + 1e-3).to(dtype)
    bits = {torch.float16: [0x0001, 0x03FF], torch.bfloat16: [0x0001, 0x007F],
            torch.float32: [0x00000001, 0x007FFFFF]}[dtype]
    view = s.view({2: torch.int16, 4: torch.int32}[s.element_size()]).flatten()
    view[:2] = torch.tensor(bits, dtype=view.dtype)
    return s


def _gptq_layer(in_f, out_f, group_size, scales_dtype, act_order, bias, gen):
    layer = GPTQLinear(in_f, out_f, bias, group_size=group_size, compute_dtype=torch.bfloat16,
                       scales_dtype=scales_dtype)
    layer.qweight = _fill_special(layer.qweight, gen)
    layer.qzeros = _fill_special(layer.qzeros, gen)
    layer.scales = _special_scales(layer.scales.shape, scales_dtype, gen)
    if act_order:
        layer.g_idx = layer.g_idx[torch.randperm(in_f, generator=gen)].contiguous()
    if bias:
        layer.bias.data.copy_(torch.randn(out_f, generator=gen))
    return layer


class _Block(nn.Module):
    def __init__(self, gen, scales_dtype):
        super().__init__()
        # 40 inputs in groups of 16 (3 groups: shards of 2 and 1 rows), act-order; one group (-1): rank 1 holds
        # no row of qzeros / scales
        self.up = _gptq_layer(40, 24, 16, scales_dtype, True, True, gen)
        self.down = _gptq_layer(24, 40, -1, torch.float32 if scales_dtype == torch.float16 else torch.bfloat16,
                                False, False, gen)
        self.adapter = nn.Linear(40, 8, bias=False)  # trainable fp32: cast to bf16 by the policy

    def forward(self, x):
        return self.down(F.silu(self.up(x))) + F.pad(self.adapter(x), (0, 32))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.blocks = nn.ModuleList([_Block(gen, torch.float16), _Block(gen, torch.bfloat16)])
        self.root_layer = _gptq_layer(40, 16, 8, torch.float16, False, False, gen)  # sharded with the root
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        for block in self.blocks:  # (no residual: FSDP2's hooks on a block's input would reorder the bf16 sum of
            x = block(x)           # the input gradient's three terms; two are summed in either order exactly)
        return self.head(self.root_layer(x))


def _gptq_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, GPTQLinear)}


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _rank_main(rank, world):
    """One rank: FSDP2 over the GPTQ net, reshard True and False (run_ranks joined the gloo group)."""
    from foak.backend import set_backend

    set_backend("reference")  # CPU: the reference ops (the kernels are tested elsewhere)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(15, 40, generator=gen) for _ in range(2)]  # two steps; 2-D: the output is no view
    results = {}
    for reshard in (True, False):
        net = _Net()
        original = {n: {k: getattr(m, k).clone() for k in PACKED} for n, m in _gptq_layers(net).items()}
        ref = copy.deepcopy(net).to(torch.bfloat16)  # the single-process model, computing as under the policy
        outs_ref, x_grads_ref = [], []
        for x in xs:
            x_ref = x.clone().requires_grad_(True)
            out_ref = ref(x_ref.bfloat16())
            out_ref.float().square().sum().backward()
            outs_ref.append(out_ref.detach())
            x_grads_ref.append(x_ref.grad)
            if not x_grads_ref[1:]:
                head_grad_ref = ref.head.weight.grad.float()

        for block in net.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(net, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        local = {}
        for name, m in _gptq_layers(net).items():
            params = {k: getattr(m, k) for k in ("qweight", "qzeros", SCALES_BITS, "g_idx")}
            assert all(isinstance(p, DTensor) for p in params.values()), {k: type(p) for k, p in params.items()}
            local[name] = {k: (p.to_local().clone(), tuple(p.shape)) for k, p in params.items()}
        gathered = {name: [] for name in original}

        def record(name):
            def hook(module, args):
                seen = {k: getattr(module, k).clone() for k in PACKED}
                seen["types"] = {type(getattr(module, k)).__name__ for k in PACKED}
                gathered[name].append(seen)
            return hook

        for name, m in _gptq_layers(net).items():
            m.register_forward_pre_hook(record(name))
        outs, x_grads = [], []
        for x in xs:  # the second step reuses each layer's GPTQWeight over the re-gathered storage
            x_fsdp = x.clone().requires_grad_(True)
            out = net(x_fsdp)
            after_forward_plain = [not isinstance(m.qweight, DTensor) for m in _gptq_layers(net).values()]
            out.float().square().sum().backward()
            outs.append(out.detach())
            x_grads.append(x_fsdp.grad)
            if not x_grads[1:]:
                head_grad = net.head.weight.grad.full_tensor()
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in net.state_dict().items()}
        results[reshard] = {
            "original": original, "local": local, "gathered": gathered, "outs": outs, "outs_ref": outs_ref,
            "x_grads": x_grads, "x_grads_ref": x_grads_ref, "head_grad": head_grad,
            "head_grad_ref": head_grad_ref, "after_forward_plain": after_forward_plain,
            "state": state, "ref_state": ref.state_dict(),
            "trainable": sorted(n for n, p in net.named_parameters() if p.requires_grad),
        }
    return results


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    return run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("fsdp"), timeout_s=TIMEOUT_S,
                     preload=("torch", "torch.distributed.fsdp", "foak.quant.gptq"))


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp2_shards_and_gathers_bit_exactly(fsdp_results, reshard):
    for rank, results in enumerate(fsdp_results):
        r = results[reshard]
        assert set(r["gathered"]) == set(r["original"]) and len(r["original"]) == 5
        for name, orig in r["original"].items():
            # (a) each rank holds its dim-0 chunk only (FSDP2's torch.chunk layout), not the full tensor
            bits = {"qweight": orig["qweight"], "qzeros": orig["qzeros"],
                    SCALES_BITS: orig["scales"].view(torch.int32), "g_idx": orig["g_idx"]}
            for key, full in bits.items():
                shard, global_shape = r["local"][name][key]
                chunks = torch.chunk(full, WORLD, dim=0)
                want = chunks[rank] if rank < len(chunks) else full[:0]
                assert global_shape == tuple(full.shape), (name, key)
                assert shard.dtype == full.dtype and torch.equal(shard, want), (rank, name, key)
                if full.shape[0] > 1:
                    assert shard.shape[0] < full.shape[0], (rank, name, key, shard.shape)
            # (b) what the forward sees: plain tensors, every bit as before (the special words included)
            assert len(r["gathered"][name]) == 2
            for seen in r["gathered"][name]:
                assert "DTensor" not in seen["types"], seen["types"]
                for key in PACKED:
                    assert _same_bits(seen[key], orig[key]), (rank, name, key)
        special = _special_words()
        assert torch.equal(r["gathered"]["blocks.0.up"][0]["qweight"].flatten()[:len(special)], special)
        assert torch.isnan(_bits(special).view(torch.int16).view(torch.float16)).sum() >= 20  # they are NaNs
        # (c) the sharded model computes what the single-process one does, bit for bit, backward included
        for out, out_ref in zip(r["outs"], r["outs_ref"], strict=True):
            assert out.dtype == torch.bfloat16 and torch.equal(out, out_ref)
        for x_grad, x_grad_ref in zip(r["x_grads"], r["x_grads_ref"], strict=True):
            assert torch.equal(x_grad, x_grad_ref)
        torch.testing.assert_close(r["head_grad"], r["head_grad_ref"], rtol=1e-6, atol=0)
        # after the forward the layers stay gathered only without reshard_after_forward
        assert r["after_forward_plain"] == [not reshard] * 5, r["after_forward_plain"]
        assert r["trainable"] == ["blocks.0.adapter.weight", "blocks.1.adapter.weight", "head.bias", "head.weight"]
        # the sharded model's state dict: the checkpoint's keys and dtypes, the bits unchanged
        for name, orig in r["original"].items():
            for key in PACKED:
                assert _same_bits(r["state"][f"{name}.{key}"], orig[key]), (name, key)
        assert set(r["state"]) == set(r["ref_state"])


# plain (one process) --------------------------------------------------------------------------------
def test_state_dict_is_the_checkpoint_format_and_loads_bit_exactly():
    gen = torch.Generator().manual_seed(2)
    layer = _gptq_layer(40, 24, 16, torch.float16, True, True, gen)
    sd = layer.state_dict()
    assert list(sd) == ["qweight", "qzeros", "scales", "g_idx", "bias"]
    assert [sd[k].dtype for k in PACKED] == [torch.int32, torch.int32, torch.float16, torch.int32]
    assert sd["scales"].shape == (3, 24) and layer.scales.dtype == torch.float16
    assert {n for n, _ in layer.named_parameters()} == {"qweight", "qzeros", SCALES_BITS, "g_idx", "bias"}
    assert not any(p.requires_grad for p in layer.parameters()) and not list(layer.buffers())
    assert layer.get_parameter(SCALES_BITS).dtype == torch.int32 and layer.get_parameter(SCALES_BITS).shape == (3, 12)
    other = GPTQLinear(40, 24, True, group_size=16, compute_dtype=torch.bfloat16)
    other.load_state_dict(sd)
    for key in PACKED:
        assert _same_bits(getattr(other, key), getattr(layer, key)), key
    assert torch.equal(other.dequantize(torch.float32), layer.dequantize(torch.float32))
    # the weight is the format's formula on the state dict's own tensors
    expected = gptq_dequantize_reference(sd["qweight"], sd["qzeros"], sd["scales"], sd["g_idx"], torch.float32)
    assert torch.equal(layer.dequantize(torch.float32), expected)
    # assign=True (meta-device builds) keeps the bits too
    meta = GPTQLinear(40, 24, True, group_size=16, compute_dtype=torch.bfloat16, device="meta")
    meta.load_state_dict(sd, assign=True)
    assert all(_same_bits(getattr(meta, k), getattr(layer, k)) for k in PACKED)
    # a state dict with other scales dtypes or shapes is refused (a conversion would change the weight)
    bad = dict(sd, scales=sd["scales"].bfloat16())
    with pytest.raises(RuntimeError, match="holds torch.bfloat16 scales but this GPTQLinear stores torch.float16"):
        other.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="size mismatch for scales: .*\\(2, 24\\)"):
        other.load_state_dict(dict(sd, scales=sd["scales"][:2]))
    missing = other.load_state_dict({k: v for k, v in sd.items() if k != "scales"}, strict=False).missing_keys
    assert missing == ["scales"]
    with pytest.raises(ValueError, match="GPTQLinear.qweight must be torch.int32"):
        layer.qweight = layer.qweight.float()


def test_weight_object_survives_an_fsdp_style_storage_refill_only():
    gen = torch.Generator().manual_seed(4)
    layer = _gptq_layer(40, 24, 16, torch.float16, True, False, gen)
    dense = layer.dequantize(torch.float32)
    first = layer.weight_object()
    # FSDP2 frees the gathered storage after a forward and refills the same storage (its version kept)
    saved = {k: getattr(layer, k).clone() for k in ("qweight", "qzeros", SCALES_BITS, "g_idx")}
    for name, value in saved.items():
        tensor = getattr(layer, name)
        storage = tensor.untyped_storage()
        size = storage.nbytes()
        storage.resize_(0)
        storage.resize_(size)
        with torch.autograd._unsafe_preserve_version_counter(tensor):
            tensor.copy_(value)
    assert layer.weight_object() is first and torch.equal(first.dequantize(torch.float32), dense)
    layer.qweight.data = saved["qweight"]  # another storage: rebuilt
    second = layer.weight_object()
    assert second is not first and torch.equal(second.dequantize(torch.float32), dense)
    with torch.no_grad():
        layer.scales.mul_(2)  # in place: a new version
    assert layer.weight_object() is not second and torch.equal(layer.dequantize(torch.float32), 2 * dense)


def test_casts_and_prepare_for_kbit_training_keep_bits(tmp_path):
    import peft

    from foak.models.tiny import tiny_model
    from foak.quant.gptq_peft import register_gptq_lora

    model = quantize_model_gptq(tiny_model("llama"), group_size=32)
    layers = _gptq_layers(model)
    layer = layers["model.layers.0.self_attn.q_proj"]
    layer.qweight.view(-1)[:len(_special_words())] = _special_words()  # NaN-pattern halves in the packed words
    original = {n: {k: getattr(m, k).clone() for k in PACKED} for n, m in layers.items()}

    def unchanged(model):  # (under PEFT the layers' names gain a prefix and ".base_layer"; the order stays)
        now = list(_gptq_layers(model).values())
        return len(now) == len(original) == 14 and all(
            _same_bits(getattr(m, k), orig[k]) for m, orig in zip(now, original.values()) for k in PACKED)

    model.to(torch.bfloat16)
    assert unchanged(model) and layer.compute_dtype == torch.bfloat16 and layer.scales.dtype == torch.float16
    model.half()
    assert unchanged(model) and layer.compute_dtype == torch.float16
    model.float()
    assert unchanged(model) and layer.compute_dtype == torch.float32
    model.type(torch.float64)  # casts every tensor, integers included, elsewhere
    assert unchanged(model)
    model.float()

    # save -> load: the checkpoint holds the GPTQ tensors under their names and dtypes, bit-exactly
    save_gptq(model, tmp_path / "ckpt")
    from safetensors.torch import load_file

    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert not any(SCALES_BITS in k for k in stored)
    assert stored["model.layers.0.self_attn.q_proj.scales"].dtype == torch.float16
    assert all(_same_bits(stored[f"{n}.{k}"], orig[k]) for n, orig in original.items() for k in PACKED)
    loaded = load_gptq(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert unchanged(loaded)

    # PEFT: prepare_model_for_kbit_training casts fp16/bf16 parameters to fp32; get_peft_model freezes
    prepared = peft.prepare_model_for_kbit_training(loaded, use_gradient_checkpointing=False)
    assert prepared.model.embed_tokens.weight.dtype == torch.float32  # the cast did run
    assert unchanged(prepared)
    config = register_gptq_lora(peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    pm = peft.get_peft_model(prepared, config)
    assert unchanged(pm)
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert len(trainable) == 8 and all("lora_" in n for n in trainable)
    frozen_ints = [p for p in pm.parameters() if not p.is_floating_point()]
    assert len(frozen_ints) == 4 * len(original) and not any(p.requires_grad for p in frozen_ints)
