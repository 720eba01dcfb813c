"""tiled_mlp: the gated MLP in sequence chunks in the forward and the backward (foak.ops.tiled, the tiled_mlp
rule in foak.patching.replacements).

* model level (torch reference backend): tiny Llama and a tiny Qwen2-MoE (its dense MLP and shared experts),
  full fine-tuning and PEFT LoRA (foak's fused LoRA MLP block underneath), without gradient checkpointing and
  under HF's non-reentrant and reentrant checkpointing, an odd token count (a last partial chunk): loss and
  every gradient equal the unpatched model's (fp32, 1e-5), and the report row counts the tiled forwards;
* op level: dropout inside the block sees the forward's RNG in the recompute; bf16 autocast over fp32 weights;
  a block that reads a trainable tensor it was not given raises instead of losing its gradient;
* memory (tests/memory_utils.py): with [L, I]-dominated shapes the step's peak (and, without checkpointing,
  what the forward keeps) drops when tiled;
* bad input: chunk size <= 0, a chunk size without the switch, FSDP.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import foak
from foak.ops.tiled import tiled

TOL = 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny(arch: str, lora: bool, checkpointing):
    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=64, use_cache=False)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                             shared_expert_intermediate_size=80, mlp_only_layers=[0])
        model = transformers.Qwen2MoeForCausalLM(config)
    model = model.float().train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                                                 init_lora_weights=False))
        if checkpointing:
            model.enable_input_require_grads()
    return model


def defaults(model, **extra):
    """foak's default switches for ``model`` (every kernel of its architecture, fused LoRA on a PEFT model)."""
    return {**foak.api.default_config(model).model_dump(exclude={"mode"}), **extra}


def batch(seq: int = 19):  # 2 x 19 = 38 tokens: chunks of 8 -> 5 chunks, the last of 6
    ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def loss_and_grads(model, data):
    model.zero_grad(set_to_none=True)
    loss = model(**data).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


_CASES = [(arch, lora, ckpt) for arch in ("llama", "qwen2_moe") for lora in (False, True)
          for ckpt in (None, False, True)]
_IDS = [f"{a}-{'lora' if lo else 'full'}-{ {None: 'no_ckpt', False: 'ckpt', True: 'ckpt_reentrant'}[c]}"
        for a, lo, c in _CASES]


@pytest.mark.parametrize(("arch", "lora", "checkpointing"), _CASES, ids=_IDS)
def test_tiled_equals_plain(arch, lora, checkpointing, reference_ops):
    ref = tiny(arch, lora, checkpointing)
    model = copy.deepcopy(ref)
    report = foak.patch(model, **defaults(model, tiled_mlp=True, tiled_mlp_chunk_tokens=8))
    try:
        data = batch()
        loss_ref, grads_ref = loss_and_grads(ref, data)
        loss, grads = loss_and_grads(model, data)
    finally:
        foak.restore(model)
    assert abs(loss.item() - loss_ref.item()) <= TOL
    assert grads.keys() == grads_ref.keys() and grads
    for name, g in grads_ref.items():
        assert grads[name] is not None, name
        assert (grads[name] - g).abs().max().item() <= TOL, name
    row = report.result(f"{arch}.tiled_mlp")
    mlps = 2  # llama: 2 layers; qwen2_moe: layer 0's dense MLP and layer 1's shared expert
    assert row.modules == mlps
    # 38 tokens in chunks of 8: 5 chunks per tiled forward. Reentrant checkpointing runs each layer twice
    # (without grad, chunked; then the recompute). Non-reentrant checkpointing's recompute stops (early stop)
    # once the last tensor the layer saved is saved again: in a Llama layer that is the MLP input (saved before
    # the chunks run); Qwen2-MoE's shared expert is followed by the routed experts, so it runs (chunked) there
    forwards = {None: mlps, True: 2 * mlps, False: mlps + (arch == "qwen2_moe")}[checkpointing]
    assert f"{forwards} forwards tiled ({5 * forwards} chunks of <= 8 tokens), 0 of < 16 tokens ran whole" \
        in row.notes, row.notes
    # the routed experts (layer 1 of the MoE model) are not tiled, and the row says so
    assert ("routed experts not tiled: 1 Qwen2MoeExperts module" in row.notes) == (arch == "qwen2_moe"), row.notes
    if lora:  # foak's fused LoRA MLP block ran underneath, chunk by chunk
        assert "fused LoRA MLP blocks" in report.result(f"{arch}.swiglu").notes


def test_tiled_equals_plain_with_kernels():
    """One case with foak's Triton kernels (in the interpreter here): PEFT LoRA through the fused LoRA MLP
    kernels, chunk by chunk, under non-reentrant checkpointing."""
    ref = tiny("llama", True, False)
    model = copy.deepcopy(ref)
    report = foak.patch(model, **defaults(model, tiled_mlp=True, tiled_mlp_chunk_tokens=16))
    data = batch()
    loss_ref, grads_ref = loss_and_grads(ref, data)
    loss, grads = loss_and_grads(model, data)
    assert abs(loss.item() - loss_ref.item()) <= TOL
    for name, g in grads_ref.items():
        assert (grads[name] - g).abs().max().item() <= TOL, name
    assert "2 forwards tiled (6 chunks of <= 16 tokens)" in report.result("llama.tiled_mlp").notes
    assert "fused LoRA MLP blocks" in report.result("llama.swiglu").notes
    assert "triton" in report.result("llama.swiglu").backend


def test_packed_batch(reference_ops):
    """A packed row (position_ids restarting, no attention mask; foak's packed attention): tiled == foak without
    tiling (the MLP is per token, chunks may span sequences)."""
    ref = tiny("llama", True, False)
    plain, model = copy.deepcopy(ref), copy.deepcopy(ref)
    foak.patch(plain, **defaults(plain))
    report = foak.patch(model, **defaults(model, tiled_mlp=True, tiled_mlp_chunk_tokens=8))
    ids = batch(seq=19)["input_ids"].reshape(1, -1)
    positions = torch.cat([torch.arange(n) for n in (11, 20, 7)]).unsqueeze(0)
    data = {"input_ids": ids, "labels": ids, "position_ids": positions}
    loss_ref, grads_ref = loss_and_grads(plain, data)
    loss, grads = loss_and_grads(model, data)
    assert abs(loss.item() - loss_ref.item()) <= TOL
    for name, g in grads_ref.items():
        assert (grads[name] - g).abs().max().item() <= TOL, name
    assert "2 forwards tiled (10 chunks of <= 8 tokens)" in report.result("llama.tiled_mlp").notes
    assert report.result("llama.packed_attention").modules


@pytest.mark.parametrize("checkpointing", [None, False, True], ids=["no_ckpt", "ckpt", "ckpt_reentrant"])
def test_extra_compute(checkpointing, reference_ops):
    """Rows through each layer's gate_proj in one step (38 tokens, chunks of 8): untiled, 1 pass (2 under
    checkpointing); tiled, one more, except under non-reentrant checkpointing, where the checkpoint's recompute
    stops after the first chunk (early stop) and the tiled backward's recompute takes its place."""
    rows = {}
    for tiled_on in (False, True):
        model = tiny("llama", False, checkpointing)
        if checkpointing:
            model.enable_input_require_grads()
        count = [0]
        for layer in model.model.layers:
            layer.mlp.gate_proj.register_forward_hook(
                lambda m, args, out: count.__setitem__(0, count[0] + args[0].numel() // args[0].shape[-1]))
        foak.patch(model, fast_rms_layernorm=True, tiled_mlp=tiled_on, **({"tiled_mlp_chunk_tokens": 8} if tiled_on else {}))
        loss_and_grads(model, batch())
        rows[tiled_on] = count[0] / 2  # per layer
    untiled = 38 * (1 if checkpointing is None else 2)
    assert rows[False] == untiled
    assert rows[True] == {None: untiled + 38, False: untiled + 8, True: untiled + 38}[checkpointing]


@pytest.mark.parametrize("checkpointing", [None, False], ids=["no_ckpt", "ckpt"])
def test_bf16_autocast_model(checkpointing, reference_ops):
    """PEFT LoRA over fp32 weights under bf16 autocast (the MLP input cast per chunk by foak's MLP rule). The
    loss equals untiled foak's; a weight gradient is the sum of per-chunk bf16 GEMMs (each rounded to bf16,
    summed in fp32) instead of one bf16 GEMM, so each gradient is compared with the fp32 run's: tiled at most
    2x as far from it as untiled foak (+ a floor of 2^-9, half a bf16 step)."""
    ref = tiny("llama", True, checkpointing)
    plain, model = copy.deepcopy(ref), copy.deepcopy(ref)
    foak.patch(plain, **defaults(plain))
    foak.patch(model, **defaults(model, tiled_mlp=True, tiled_mlp_chunk_tokens=8))
    data = batch()
    _, exact = loss_and_grads(plain, data)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_ref, grads_ref = loss_and_grads(plain, data)
        loss, grads = loss_and_grads(model, data)
    assert abs(loss.item() - loss_ref.item()) <= 1e-6
    for name, g in exact.items():
        assert grads[name].dtype == torch.float32
        scale = g.abs().max().clamp_min(1e-12)
        err, err_ref = ((grads[name] - g).abs().max() / scale).item(), ((grads_ref[name] - g).abs().max() / scale).item()
        assert err <= 2 * err_ref + 2 ** -9, (name, err, err_ref)


def test_short_inputs_run_whole(reference_ops):
    ref = tiny("llama", False, None)
    model = copy.deepcopy(ref)
    report = foak.patch(model, fast_swiglu=True, tiled_mlp=True, tiled_mlp_chunk_tokens=8)
    data = batch(seq=7)  # 14 tokens < 2 chunks
    loss_ref, grads_ref = loss_and_grads(ref, data)
    loss, grads = loss_and_grads(model, data)
    assert loss.item() == pytest.approx(loss_ref.item(), abs=TOL)
    assert "0 forwards tiled (0 chunks of <= 8 tokens), 2 of < 16 tokens ran whole" in \
        report.result("llama.tiled_mlp").notes


def test_default_chunk_is_hidden_size_and_tiled_mlp_is_opt_in(reference_ops):
    model = tiny("llama", False, None)
    assert not foak.api.default_config(model).tiled_mlp
    report = foak.patch(model, fast_swiglu=True, tiled_mlp=True)
    model(**batch(seq=40))  # 80 tokens, chunk 32 (hidden size): 3 chunks
    assert "2 forwards tiled (6 chunks of <= 32 tokens)" in report.result("llama.tiled_mlp").notes


def _mlp_block():
    torch.manual_seed(0)
    w1 = (torch.randn(24, 8) * 0.3).requires_grad_()
    w2 = (torch.randn(12, 24) * 0.2).requires_grad_()
    return w1, w2


def test_dropout_in_the_block_sees_the_forward_rng():
    """The recompute restores the forward's RNG state: the gradients are those of the dropout masks the
    forward drew (the reference draws them chunk by chunk in the same order)."""
    w1, w2 = _mlp_block()
    x = torch.randn(3, 7, 8, requires_grad=True)

    def fn(xc):
        return torch.nn.functional.dropout(torch.nn.functional.silu(xc @ w1.T), 0.5, training=True) @ w2.T

    torch.manual_seed(7)
    ref = torch.cat([fn(c) for c in x.reshape(-1, 8).split(5)]).view(3, 7, 12)
    ref.pow(2).sum().backward()
    grads_ref = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    torch.manual_seed(7)
    out = tiled(fn, x, [w1, w2], 5)
    torch.randn(100)  # RNG used between forward and backward
    out.pow(2).sum().backward()
    assert (out - ref).abs().max().item() <= TOL
    for g, g_ref in zip((x.grad, w1.grad, w2.grad), grads_ref):
        assert (g - g_ref).abs().max().item() <= TOL


def test_bf16_autocast_over_fp32_weights():
    """The recompute runs under the forward's autocast state (bf16 matmuls), so its gradients are those of
    the bf16 block, chunk by chunk."""
    w1, w2 = _mlp_block()
    x = torch.randn(2, 9, 8, requires_grad=True)

    def fn(xc):
        return torch.nn.functional.silu(xc @ w1.T) @ w2.T

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.cat([fn(c) for c in x.reshape(-1, 8).split(4)]).view(2, 9, 12)
    ref.float().pow(2).sum().backward()
    grads_ref = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tiled(fn, x, [w1, w2], 4)
    assert out.dtype == torch.bfloat16
    out.float().pow(2).sum().backward()  # outside autocast, as a trainer's backward is
    assert torch.equal(out, ref)
    for g, g_ref in zip((x.grad, w1.grad, w2.grad), grads_ref):
        assert torch.equal(g, g_ref)


def test_a_trainable_tensor_not_given_raises():
    w1, w2 = _mlp_block()
    x = torch.randn(10, 8, requires_grad=True)
    out = tiled(lambda xc: (xc @ w1.T) @ w2.T, x, [w1], 4)  # w2 not given
    with pytest.raises(RuntimeError, match="was not given"):
        out.sum().backward()


def test_bad_chunk_size():
    w1, _ = _mlp_block()
    with pytest.raises(ValueError, match="chunk_tokens must be a positive integer, got 0"):
        tiled(lambda xc: xc @ w1.T, torch.randn(4, 8), [w1], 0)
    model = tiny("llama", False, None)
    with pytest.raises(ValueError, match=r"tiled_mlp_chunk_tokens must be a positive number of tokens, got -1"):
        foak.patch(model, tiled_mlp=True, tiled_mlp_chunk_tokens=-1)
    with pytest.raises(ValueError, match="tiled_mlp_chunk_tokens is set .* but tiled_mlp is off"):
        foak.patch(model, fast_swiglu=True, tiled_mlp_chunk_tokens=64)
    from foak.config import load_config

    with pytest.raises(ValueError, match="expected a positive integer"):
        load_config({"training": {"fused_ops_and_kernels": {"tiled_mlp": True, "tiled_mlp_chunk_tokens": "big"}}})
    cfg = load_config({"training": {"fused_ops_and_kernels": {"tiled_mlp": True, "tiled_mlp_chunk_tokens": 512}}})
    assert cfg.tiled_mlp and cfg.tiled_mlp_chunk_tokens == 512 and "tiled_mlp" in cfg.enabled_rules()


def test_refuses_under_fsdp(reference_ops):
    """FSDP wraps decoder layers (FSDP2's fully_shard swaps the layer's class for one deriving from
    FSDPModule); tiled_mlp is not verified there: a clear error, not silently wrong gradients."""
    model = tiny("llama", False, None)
    foak.patch(model, fast_swiglu=True, tiled_mlp=True, tiled_mlp_chunk_tokens=8)
    layer = model.model.layers[0]
    fsdp_module = type("FSDPModule", (), {})
    layer.__class__ = type("FSDPLlamaDecoderLayer", (fsdp_module, type(layer)), {})
    with pytest.raises(RuntimeError, match="wrapped by FSDP"):
        model(**batch())


# ---- memory ------------------------------------------------------------------------------------------------
L, HIDDEN, INTER, CHUNK = 128, 16, 256, 16
UNIT = L * INTER * 4  # one fp32 [L, I] tensor


@pytest.mark.parametrize("checkpointing", [None, False], ids=["no_ckpt", "ckpt"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tiled_mlp_lowers_the_peak(lora, checkpointing, reference_ops):
    from memory_utils import step_memory

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=32, use_cache=False)
    base = transformers.LlamaForCausalLM(config).float().train()
    if checkpointing is not None:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    if lora:
        from peft import LoraConfig, get_peft_model

        base = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    model = copy.deepcopy(base)
    foak.patch(base, **defaults(base))
    foak.patch(model, **defaults(model, tiled_mlp=True, tiled_mlp_chunk_tokens=CHUNK))
    ids = torch.randint(0, 32, (1, L), generator=torch.Generator().manual_seed(1))
    data = {"input_ids": ids, "labels": ids}
    plain, ours = step_memory(base, data), step_memory(model, data)
    summary = {k: (round(plain[k] / UNIT, 3), round(ours[k] / UNIT, 3)) for k in plain}
    print(f"[L, I] units (foak, foak + tiled_mlp): {summary}")
    # the [L, I] tensors of the MLP's recompute / backward (g, u, their product, their gradients) are
    # [CHUNK, I] now: at least three whole [L, I] tensors less at the peak (measured: full 7.3 -> 2.9 [L, I]
    # under checkpointing, 11.6 -> 3.1 without; LoRA 6.9 -> 1.9 and 11.3 -> 2.3)
    assert ours["peak"] <= plain["peak"] - 3 * UNIT, summary
    if checkpointing is None:  # without checkpointing each layer kept g and u for the backward; now only x
        assert ours["retained"] <= plain["retained"] - 2 * UNIT * 2, summary  # 2 layers


# ---- DDP and FSDP2 (two gloo processes) --------------------------------------------------------------------
def _ranks(rank, world):
    """Each rank: a tiled LoRA Llama under DDP on its half of the batch (gradients all-reduced by DDP's hooks,
    which the tiled backward reaches through the ordinary graph), then the same model under FSDP2."""
    import torch.distributed as dist

    foak.set_backend("reference")
    model = tiny("llama", True, False)
    report = foak.patch(model, **defaults(model, tiled_mlp=True, tiled_mlp_chunk_tokens=8))
    from torch.nn.parallel import DistributedDataParallel

    run = DistributedDataParallel(model)
    ids = batch()["input_ids"][rank:rank + 1]
    run(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    from torch.distributed.fsdp import fully_shard

    sharded = tiny("llama", True, False)
    foak.patch(sharded, **defaults(sharded, tiled_mlp=True, tiled_mlp_chunk_tokens=8))
    for layer in sharded.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    try:
        sharded(input_ids=ids, labels=ids)
        fsdp_error = None
    except RuntimeError as err:
        fsdp_error = str(err)
    dist.barrier()
    return {"grads": grads, "fsdp_error": fsdp_error, "tiled": report.result("llama.tiled_mlp").notes}


def test_ddp_gets_the_tiled_gradients_and_fsdp2_is_refused(tmp_path, reference_ops):
    from distributed_utils import run_ranks

    results = run_ranks(_ranks, 2, tmp_path, preload=("torch", "torch.distributed.fsdp", "transformers", "peft"))
    ref = tiny("llama", True, False)
    ref.zero_grad(set_to_none=True)
    ids = batch()["input_ids"]
    # DDP averages the ranks' gradients: the mean of the two one-row losses' gradients
    (ref(input_ids=ids[:1], labels=ids[:1]).loss / 2 + ref(input_ids=ids[1:], labels=ids[1:]).loss / 2).backward()
    for out in results:
        for name, p in ref.named_parameters():
            if p.requires_grad:
                assert (out["grads"][name] - p.grad).abs().max().item() <= TOL, name
        assert out["tiled"].startswith("2 forwards tiled (6 chunks of <= 8 tokens)"), out["tiled"]  # 19 tokens, 2 layers
        assert "wrapped by FSDP" in out["fsdp_error"]
