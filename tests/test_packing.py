"""fast_packed_attention (foak.patching.packed_attention, foak.ops.varlen_attention): a packed batch (rows of
several sequences, position_ids restarting, no attention_mask) attends per sequence through foak's varlen
attention and equals every sequence run alone through the unpatched model (loss and every gradient, fp32
within 1e-5) for Llama, Mistral with a window shorter than its sequences, Qwen3 and Mixtral, with and without
gradient checkpointing; tokens of one sequence never reach another (forward or backward); unpacked batches
are bit-identical to the unpatched model; the report counts both kinds of calls; restore; TRL's padding-free
packing runs it (foak train --packing: tests/test_train.py). Op level: the per-sequence SDPA backend against explicit
fp64 math, and the sequence boundaries against transformers' find_packed_sequence_indices; attention sinks
(``sinks``: the CPU flash path, the explicit-math fallback, the flash path's code with aten's CUDA kernel
emulated on the CPU, and flash itself where CUDA is present) against an fp64 softmax over [scores, sink].

On the CPU the packed path is the per-sequence SDPA backend (torch has no FlexAttention backward and no
flash kernel there); the GPU backends are measured by benchmarks/packing.py. No Triton kernel runs here.
"""

from __future__ import annotations

import copy
import functools
import gc

import pytest
import torch
import transformers
from torch import nn

import foak
from foak.ops import varlen_attention as va
from foak.patching.packed_attention import is_registered, packed_attention_counts, window_attention_counts
from foak.testing import relative_error

VOCAB = 61
_COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
SPECS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 5}),  # shorter than most sequences below
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    # no router aux loss: it is a statistic of the whole batch, not of each sequence
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": False}),
}
# two rows of 23: row 0 packs sequences of random lengths with a 1-token one, row 1 is one sequence of the
# full row (the longest possible)
S = 23


def build(arch: str, seed: int = 0, **overrides) -> nn.Module:
    config_cls, kwargs = SPECS[arch]
    attn = overrides.pop("attn_implementation", "sdpa")
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs, **overrides})
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.config.use_cache = False
    return model


def random_lengths(total: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1]
    while sum(lengths) < total:
        lengths.append(min(total - sum(lengths), int(torch.randint(2, 10, (1,), generator=g))))
    order = torch.randperm(len(lengths), generator=g).tolist()
    return [lengths[i] for i in order]


def packed(rows: list[list[int]], seed: int = 3):
    """input_ids, position_ids [len(rows), width] and the (row, start, length) of every sequence."""
    g = torch.Generator().manual_seed(seed)
    width = sum(rows[0])
    ids = torch.randint(3, VOCAB, (len(rows), width), generator=g)
    pos = torch.zeros_like(ids)
    spans = []
    for r, lengths in enumerate(rows):
        assert sum(lengths) == width
        start = 0
        for n in lengths:
            pos[r, start:start + n] = torch.arange(n)
            spans.append((r, start, n))
            start += n
    return ids, pos, spans


def sequence_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy within one sequence ([n, V] logits, [n] ids)."""
    return nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def alone(model, ids, spans):
    """Loss (sum over sequences) and gradients with each sequence run alone through ``model``."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for r, start, n in spans:
        seq = ids[r:r + 1, start:start + n]
        loss = sequence_loss(model(input_ids=seq).logits[0], seq[0])
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_loss(model, ids, pos, spans, **kwargs):
    logits = model(input_ids=ids, position_ids=pos, **kwargs).logits
    return sum(sequence_loss(logits[r, start:start + n], ids[r, start:start + n]) for r, start, n in spans)


def assert_grads_close(grads, ref, what, tol=1e-5):
    assert grads.keys() == ref.keys() and grads
    for name, g in ref.items():
        err = relative_error(grads[name], g)
        assert err <= tol, f"{what}: grad of {name}: relative error {err:.3g}"


def rows_for(arch: str) -> list[list[int]]:
    return [random_lengths(S, seed=len(arch)), [S]]


# ---- a packed batch equals each sequence alone ------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("arch", list(SPECS))
def test_packed_batch_equals_each_sequence_alone(arch, checkpointing):
    model = build(arch)
    ids, pos, spans = packed(rows_for(arch))
    ref_loss, ref_grads = alone(model, ids, spans)  # the unpatched model, one sequence at a time
    report = foak.patch(model, fast_packed_attention=True)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    loss = packed_loss(model, ids, pos, spans)
    assert abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_grads_close(grads_of(model, loss), ref_grads, arch)
    calls, other = packed_attention_counts(report, f"{arch}.packed_attention")
    layers = model.config.num_hidden_layers
    # recomputed layers run their attention again in the backward: still packed (found by position_ids)
    assert calls == {"sdpa": layers * (2 if checkpointing else 1)} and other == {}
    foak.restore(model)


def test_every_switch_together_on_a_packed_batch():
    # foak.patch(model): the kernels (Triton interpreter here: few tokens) around the packed attention; the
    # RMSNorm recompute also wraps the decoder stack's forward
    model = build("llama")
    ids, pos, spans = packed([[4, 1, 6]])
    ref_loss, ref_grads = alone(model, ids, spans)
    report = foak.patch(model)
    assert {r.switch for r in report.results if r.modules} >= {"rms_norm", "rope", "swiglu", "packed_attention"}
    model.train()
    loss = packed_loss(model, ids, pos, spans)
    assert abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_grads_close(grads_of(model, loss), ref_grads, "every switch")
    assert packed_attention_counts(report, "llama.packed_attention") == ({"sdpa": 2}, {})


def test_hf_own_packing_agrees_and_the_window_really_cuts():
    # the comparison above is against the unpatched model alone; transformers' own packed path agrees too,
    # and Mistral's window changes the result (so the test above checks it)
    model = build("mistral")
    ids, pos, spans = packed(rows_for("mistral"))
    hf = packed_loss(model, ids, pos, spans).item()
    ref, _ = alone(model, ids, spans)
    assert abs(hf - ref) <= 1e-5 * ref
    wide = build("mistral", sliding_window=64)
    assert abs(packed_loss(wide, ids, pos, spans).item() - hf) > 1e-4 * hf  # 100x the tolerance


def test_packed_batch_under_bf16_autocast_matches_transformers_packed_path():
    # HF's RoPE leaves q/k in fp32 under autocast over fp32 weights (v is bf16): foak casts them as SDPA does
    model = build("mistral")
    ids, pos, spans = packed(rows_for("mistral"))
    reference = copy.deepcopy(model)
    report = foak.patch(model, fast_packed_attention=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = packed_loss(model, ids, pos, spans)
        ref = packed_loss(reference, ids, pos, spans)  # transformers' dense block-causal mask, bf16 SDPA
    assert loss.dtype == ref.dtype and abs(loss.item() - ref.item()) <= 1e-2 * ref.item()
    grads, ref_grads = grads_of(model, loss), grads_of(reference, ref)
    assert_grads_close(grads, ref_grads, "bf16 autocast", tol=3e-2)
    assert packed_attention_counts(report, "mistral.packed_attention") == ({"sdpa": 2}, {})


# ---- no attention across sequences ------------------------------------------------------------------------


def test_no_attention_across_sequences_forward_or_backward():
    """Sequence 1 of a row alters nothing of sequence 2: its outputs are bit-identical when sequence 1's
    tokens change, and a loss on sequence 2 alone gives sequence 1's input embeddings exactly zero
    gradient. transformers' sdpa with a KV cache (use_cache=True: it does not look for packing then) fails
    both checks, so they catch cross-sequence attention; foak keeps the sequences apart there too."""
    lengths = [9, 1, 13]
    ids, pos, _ = packed([lengths])
    other = ids.clone()
    other[0, :9] = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(9))
    second = slice(10, 23)

    def probe(model, use_cache):
        out = []
        for x in (ids, other):
            embeds = model.get_input_embeddings()(x).detach().requires_grad_()
            logits = model(inputs_embeds=embeds, position_ids=pos, use_cache=use_cache).logits
            logits[0, second].sum().backward()
            out.append((logits[0, second].detach(), embeds.grad[0, :10].abs().max().item()))
        return out

    model = build("llama")
    (a, leak), (b, _) = probe(model, use_cache=True)
    assert not torch.equal(a, b) and leak > 0  # transformers' sdpa with a cache: sequences see each other
    report = foak.patch(model, fast_packed_attention=True)
    for use_cache in (False, True):
        (a, leak), (b, leak_b) = probe(model, use_cache)
        assert torch.equal(a, b) and leak == 0.0 and leak_b == 0.0
    calls, other_calls = packed_attention_counts(report, "llama.packed_attention")
    assert calls == {"sdpa": 8} and other_calls == {}


# ---- unpacked batches unchanged --------------------------------------------------------------------------


def unpacked_batches():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    padded = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    plain = {"input_ids": ids, "labels": ids}
    explicit = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(11)[None].expand(2, -1) + 4}
    # restarting position_ids with an attention_mask: transformers does not treat it as packed, neither does foak
    with_mask = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids),
                 "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]] * 2)}
    return {"padded": padded, "plain": plain, "explicit": explicit, "mask+restart": with_mask}


@pytest.mark.parametrize(("arch", "attn"), [("llama", "sdpa"), ("qwen3", "eager")])
def test_unpacked_batches_are_bit_identical_to_the_unpatched_model(arch, attn):
    """(Sliding-window layers of unpacked batches take foak's windowed path: tests/test_window_attention.py and
    test_unpacked_batches_of_a_sliding_window_model_take_the_windowed_path below.)"""
    model = build(arch, attn_implementation=attn)
    reference = copy.deepcopy(model)
    report = foak.patch(model, fast_packed_attention=True)
    assert model.config._attn_implementation == "foak" and reference.config._attn_implementation == attn
    for name, batch in unpacked_batches().items():
        out = model(**batch)
        ref = reference(**batch)
        assert torch.equal(out.logits, ref.logits), name
        grads, ref_grads = grads_of(model, out.loss), grads_of(reference, ref.loss)
        assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads), name
    calls, other = packed_attention_counts(report, f"{arch}.packed_attention")
    assert calls == {} and other == {"not a packed batch": 4 * model.config.num_hidden_layers}
    row = report.result(f"{arch}.packed_attention")
    assert f"the previous implementation ({attn}) ran 8 calls: not a packed batch (8)" in row.notes
    assert f"config._attn_implementation: {attn!r} -> 'foak'" in row.notes


def test_unpacked_batches_of_a_sliding_window_model_take_the_windowed_path():
    model = build("mistral")
    reference = copy.deepcopy(model)
    report = foak.patch(model, fast_packed_attention=True)
    for name, batch in unpacked_batches().items():
        out, ref = model(**batch), reference(**batch)
        assert relative_error(out.loss, ref.loss) <= 1e-5, name
        assert_grads_close(grads_of(model, out.loss), grads_of(reference, ref.loss), name)
    assert packed_attention_counts(report, "mistral.packed_attention") == ({}, {})
    assert window_attention_counts(report, "mistral.packed_attention") == {"sdpa": 4 * model.config.num_hidden_layers}


# ---- the rule: selection, report, restore, implementations it leaves alone -------------------------------


def test_patch_selects_foak_and_restore_puts_the_previous_implementation_back():
    gc.collect()  # patched models of earlier tests release foak's registration when they are collected
    assert not is_registered()
    model = build("llama")
    hf = model.model.forward
    report = foak.patch(model, fast_packed_attention=True)
    row = report.result("llama.packed_attention")
    assert row.modules == 1 and row.backend == va.policy() and is_registered()
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert "foak" in ALL_ATTENTION_FUNCTIONS and "foak" in ALL_MASK_ATTENTION_FUNCTIONS
    foak.restore(model)
    assert model.config._attn_implementation == "sdpa" and "forward" not in model.model.__dict__
    assert model.model.forward == hf and not is_registered()
    assert "foak" not in ALL_ATTENTION_FUNCTIONS and "foak" not in ALL_MASK_ATTENTION_FUNCTIONS


@pytest.mark.parametrize("attn", ["flex_attention", "flash_attention_2"])
def test_implementations_that_handle_packing_themselves_are_left_alone(attn):
    model = build("llama")
    model.config._attn_implementation = attn
    report = foak.patch(model, fast_packed_attention=True)
    row = report.result("llama.packed_attention")
    assert row.modules == 0 and f"config._attn_implementation is {attn!r}" in row.notes
    assert model.config._attn_implementation == attn and "forward" not in model.model.__dict__


def test_default_config_has_it_and_a_deepcopy_gets_its_own_patch():
    from foak.api import default_config

    assert default_config(build("llama")).fast_packed_attention
    model = build("llama")
    report = foak.patch(model, fast_packed_attention=True)
    clone = copy.deepcopy(model)
    assert clone.config is not model.config and clone.config._attn_implementation == "foak"
    ids, pos, spans = packed(rows_for("llama"))
    a = packed_loss(model, ids, pos, spans)
    b = packed_loss(clone, ids, pos, spans)
    assert torch.equal(a, b)
    calls, _ = packed_attention_counts(report, "llama.packed_attention")
    assert calls == {"sdpa": 2}  # the clone's calls are counted in its own report


# ---- TRL's padding-free packing (foak train --packing: tests/test_train.py) ------------------------------------


def test_trl_padding_free_packing_runs_the_packed_attention_and_matches_trl(tmp_path):
    import datasets
    import trl

    from foak.data import char_tokenizer

    texts = ["the cat sees the ball.", "a dog likes two apples at home.", "1 2 3 4 5.", "our team calls the river.",
             "seven small boats sail.", "rain falls on the hill."]

    def step(patch: bool):
        tokenizer = char_tokenizer()
        model = build("llama")
        model.resize_token_embeddings(len(tokenizer))
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        report = foak.patch(model, fast_packed_attention=True) if patch else None
        config = trl.SFTConfig(output_dir=str(tmp_path / str(patch)), max_steps=1, per_device_train_batch_size=6,
                               learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", max_grad_norm=1e9,
                               report_to="none", save_strategy="no", seed=3, max_length=64, packing=True,
                               padding_free=True, dataset_num_proc=None, bf16=False, gradient_checkpointing=False,
                               use_cpu=True)
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_dict({"text": texts}),
                                 processing_class=tokenizer)
        loss = trainer.train().training_loss
        return loss, {n: p.detach() - start[n] for n, p in model.named_parameters()}, report

    loss, updates, report = step(True)
    ref_loss, ref_updates, _ = step(False)
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    for name, update in ref_updates.items():
        assert relative_error(updates[name], update) < 1e-4, name
    calls, other = packed_attention_counts(report, "llama.packed_attention")
    assert calls == {"sdpa": 2} and other == {}


# ---- the op ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 4])
def test_sdpa_backend_matches_explicit_math(window):
    lengths = (5, 1, 12, 3, 1, 9)
    seqs = va.sequences_from_lengths(lengths)
    g = torch.Generator().manual_seed(0)
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, 8, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out = va.varlen_attention(*leaves, seqs, scale=0.3, window=window, backend="sdpa")
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = va.varlen_attention_reference(*ref_leaves, seqs, scale=0.3, window=window)
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    out.backward(grad.float())
    ref.backward(grad)
    assert relative_error(out, ref) <= 1e-6
    for name, a, b in zip("qkv", leaves, ref_leaves):
        assert relative_error(a.grad, b.grad) <= 1e-6, name
    assert va.resolve_backend(leaves[0], leaves[2]) == "sdpa"  # auto on the CPU


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backend_document_mask_matches_explicit_math():
    # FlexAttention has no backward on the CPU: its forward checks the document mask, the window and GQA here
    lengths = (5, 1, 12, 3)
    seqs = va.sequences_from_lengths(lengths, batch=1)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(sum(lengths), h, 8, generator=g) for h in (4, 2, 2))
    for window in (None, 4):
        with torch.no_grad():
            out = va.varlen_attention(q, k, v, seqs, window=window, backend="flex")
        ref = va.varlen_attention_reference(q.double(), k.double(), v.double(), seqs, window=window)
        assert relative_error(out, ref) <= 1e-5, window


def test_sequences_are_the_ones_transformers_finds():
    from transformers.masking_utils import find_packed_sequence_indices

    rows = [torch.cat([torch.arange(n) + s for n, s in ((3, 0), (1, 0), (4, 7), (5, 0))]),
            torch.arange(13) + 2,  # one sequence, starting at position 2 (a row continuing another)
            torch.cat([torch.arange(6), torch.arange(7)])]
    pos = torch.stack(rows)
    seqs = va.packed_sequences(pos)
    hf = find_packed_sequence_indices(pos)
    expected = []
    for r in range(pos.shape[0]):
        expected += torch.unique_consecutive(hf[r], return_counts=True)[1].tolist()
    assert list(seqs.lengths) == expected and seqs.max_seqlen == max(expected) and seqs.total == 39
    assert seqs.cu_seqlens.dtype == torch.int32 and seqs.cu_seqlens.tolist() == [0, *torch.tensor(expected).cumsum(0)]
    assert va.packed_sequences(torch.arange(9)[None].expand(3, -1)) is None  # nothing restarts: not packed
    shared = va.packed_sequences(torch.tensor([[0, 1, 0, 1, 2]]), batch_size=2)  # [1, S] shared by 2 rows
    assert shared.lengths == (2, 3, 2, 3) and shared.batch == 2


def test_bad_inputs_are_errors():
    seqs = va.sequences_from_lengths((3, 4))
    q, k = torch.randn(7, 4, 8), torch.randn(7, 2, 8)
    with pytest.raises(ValueError, match="cannot run tensors on cpu"):
        va.varlen_attention(q, k, k, seqs, backend="flash")
    with pytest.raises(ValueError, match="unknown packed-attention backend"):
        va.set_backend("fast")
    with pytest.raises(ValueError, match="not a multiple"):
        va.varlen_attention(q, torch.randn(7, 3, 8), torch.randn(7, 3, 8), seqs)
    with pytest.raises(ValueError, match="tokens, but the sequences hold 7"):
        va.varlen_attention(q[:6], k[:6], k[:6], seqs)
    with pytest.raises(ValueError, match="window must be a positive int"):
        va.varlen_attention(q, k, k, seqs, window=0)
    with pytest.raises(ValueError, match="crosses a row boundary"):
        va.sequences_from_lengths((3, 4, 1), batch=2)
    with pytest.raises(ValueError, match="integer tensor"):
        va.packed_sequences(torch.zeros(2, 3))


# ---- attention sinks (gpt-oss): a sink logit per head joins every softmax row ---------------------------


def _sink_case(dtype, lengths=(5, 1, 12, 3, 1, 9), batch=1, heads=(6, 2), seed=0):
    seqs = va.sequences_from_lengths(lengths, batch=batch)
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, 8, generator=g, dtype=torch.float64) for h in (heads[0], heads[1], heads[1]))
    sinks = torch.randn(heads[0], generator=g, dtype=torch.float64) * 2
    grad = torch.randn(T, heads[0], 8, generator=g, dtype=torch.float64)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    return seqs, (q, k, v, sinks), grad, ref_leaves


def _check_sinks_against_fp64(run, dtype, window, tol, **case):
    seqs, inputs, grad, ref_leaves = _sink_case(dtype, **case)
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    out = run(*leaves[:3], seqs, scale=0.3, window=window, sinks=leaves[3])
    ref = va.varlen_attention_reference(*ref_leaves[:3], seqs, scale=0.3, window=window, sinks=ref_leaves[3])
    out.backward(grad.to(dtype))
    ref.backward(grad)
    assert out.dtype == dtype and relative_error(out, ref) <= tol
    for name, a, b in zip(("q", "k", "v", "sinks"), leaves, ref_leaves):
        assert a.grad.dtype == dtype and relative_error(a.grad, b.grad) <= tol, name
    return out, ref


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 4, 100])
def test_sinks_sdpa_backend_matches_fp64_softmax_over_scores_and_sink(dtype, tol, window):
    # the CPU path: torch's CPU flash entry points per sequence (out, lse), the sink joined from lse; odd
    # lengths, sequences of one token, GQA (6 query heads on 2 K/V heads), a window shorter than some sequences
    run = functools.partial(va.varlen_attention, backend="sdpa")
    out, ref = _check_sinks_against_fp64(run, dtype, window, tol, batch=1)
    # the sink really takes probability: without it the output differs
    seqs, (q, k, v, _), _, _ = _sink_case(dtype)
    plain = va.varlen_attention_reference(q, k, v, seqs, scale=0.3, window=window)
    assert relative_error(plain, ref) > 0.05


def test_sinks_of_several_rows_and_the_math_fallback():
    # two rows of packed sequences (a sequence ends at each row end); the explicit-math path (fp32 off the CPU)
    run = functools.partial(va.varlen_attention, backend="sdpa")
    _check_sinks_against_fp64(run, torch.float32, 3, 1e-6, lengths=(5, 6, 3, 7, 1), batch=2, heads=(4, 4))
    def math(q, k, v, seqs, scale, window, sinks):
        return va._math_sinks(q, k, v, seqs, scale, window, sinks)

    _check_sinks_against_fp64(math, torch.float32, 3, 1e-6, lengths=(5, 6, 3, 7, 1), batch=2, heads=(4, 2))


def _cpu_flash_varlen_forward(q, k, v, cu, cu_k, max_q, max_k, dropout, causal, debug, *, scale,
                              window_size_left, window_size_right):
    """aten's CUDA varlen flash forward emulated on the CPU (its layouts: out [T, H, D], lse [H, T])."""
    assert causal and dropout == 0.0 and (window_size_right in (None, 0))
    window = None if window_size_left is None else window_size_left + 1
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        n = end - start
        qs, ks, vs = (va._heads_first(t, start, n, gr) for t, gr in ((q, 1), (k, group), (v, group)))
        mask = va._band_mask(n, window, q)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, ks, vs, 0.0, mask is None,
                                                                           attn_mask=mask, scale=scale)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0].float())
    empty = torch.empty(0)
    return torch.cat(outs), torch.cat(lses, 1), empty, empty, empty


def _cpu_flash_varlen_backward(dout, q, k, v, out, lse, cu, cu_k, max_q, max_k, dropout, causal, rng, unused, *,
                               scale, window_size_left, window_size_right):
    window = None if window_size_left is None else window_size_left + 1
    Hkv = k.shape[1]
    group = q.shape[1] // Hkv
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        n = end - start
        qs, ks, vs = (va._heads_first(t, start, n, gr) for t, gr in ((q, 1), (k, group), (v, group)))
        dos, os_ = (va._heads_first(t, start, n, 1) for t in (dout, out))
        mask = va._band_mask(n, window, q)
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dos, qs, ks, vs, os_, lse[None, :, start:end].to(q.dtype if q.dtype == torch.float64 else torch.float32)
            .contiguous(), 0.0, mask is None, attn_mask=mask, scale=scale)
        dq[start:end] = gq[0].transpose(0, 1)
        dk[start:end] = gk[0].reshape(Hkv, group, n, -1).sum(1).transpose(0, 1)
        dv[start:end] = gv[0].reshape(Hkv, group, n, -1).sum(1).transpose(0, 1)
    return dq, dk, dv


@pytest.mark.parametrize("window", [None, 4])
def test_sinks_flash_glue_with_the_cuda_kernel_emulated_on_the_cpu(monkeypatch, window):
    # the flash path's own code (sink joined to the kernel's [H, T] lse, the kernel's backward called with the
    # final out and lse, d sinks) with aten's varlen flash kernel replaced by the CPU flash per sequence
    monkeypatch.setattr(va, "_aten_flash_forward", _cpu_flash_varlen_forward)
    monkeypatch.setattr(va, "_aten_flash_backward", _cpu_flash_varlen_backward)

    def run(q, k, v, seqs, scale, window, sinks):
        return va._flash_sinks(q, k, v, seqs, scale, window, sinks)

    _check_sinks_against_fp64(run, torch.float32, window, 1e-6)
    _check_sinks_against_fp64(run, torch.bfloat16, window, 2e-2, lengths=(5, 6, 3, 7, 1), batch=2)


def test_sinks_bad_inputs_are_errors():
    seqs = va.sequences_from_lengths((3, 4))
    q, k = torch.randn(7, 4, 8), torch.randn(7, 2, 8)
    with pytest.raises(ValueError, match=r"sinks must be a floating tensor \[4\]"):
        va.varlen_attention(q, k, k, seqs, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="backend 'flex' takes no attention sinks"):
        va.varlen_attention(q, k, k, seqs, sinks=torch.zeros(4), backend="flex")
