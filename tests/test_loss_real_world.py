"""The losses in the setups users run: fp32 logits far from 0, fp16 with loss scaling, autocast over fp32
weights, per-class weights, logging statistics, fp32 weight-gradient accumulation, TRL-style per-token
losses. Every check compares with torch eager (and fp64 where precision is the point), not only with foak's
own reference."""

import pytest
import torch
import torch.nn.functional as F

import foak.ops.linear_cross_entropy as lce_module
from foak.ops.cross_entropy import cross_entropy, cross_entropy_reference
from foak.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from foak.testing import relative_error


ALL_SWITCHES = dict(fast_rms_layernorm=True, fast_rope_embeddings=True, fast_swiglu=True, fused_linear_loss=True)


def _tiny_llama(patched, vocab_size=None):
    """The tiny Llama of foak.models.tiny (fp32 weights), patched with every switch or not."""
    import transformers

    import foak
    from foak.models.tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config("llama")
    if vocab_size:
        config.vocab_size = vocab_size
    model = transformers.AutoModelForCausalLM.from_config(config)
    if patched:
        foak.patch(model, **ALL_SWITCHES)
    return model


def _target(n, vocab, ignored_every=5):
    t = torch.randint(0, vocab, (n,))
    t[::ignored_every] = -100
    return t


def _logits(kind, n, vocab):
    if kind == "pm1e4":
        return (torch.rand(n, vocab, dtype=torch.float64) * 2 - 1) * 1e4
    if kind == "offset1e4":
        return torch.randn(n, vocab, dtype=torch.float64) * 3 + 1e4
    return torch.randn(n, vocab, dtype=torch.float64) * 3


# ---- 1. fp32 precision for large logits (item 7) ------------------------------------------------------
@pytest.mark.parametrize("kind", ["pm1e4", "offset1e4", "normal"])
@pytest.mark.parametrize("vocab", [1029, 20011])  # one block per row, and more than one (block 16384)
def test_cross_entropy_fp32_gradient_is_as_precise_as_torch_for_large_logits(kind, vocab):
    n = 37 if vocab < 5000 else 7
    x64 = _logits(kind, n, vocab).float().double()  # exactly representable in fp32
    target = _target(n, vocab)
    ref = x64.clone().requires_grad_()
    F.cross_entropy(ref, target).backward()
    eager = x64.float().requires_grad_()
    F.cross_entropy(eager, target).backward()
    ours = x64.float().requires_grad_()
    loss = cross_entropy(ours, target)
    loss.backward()
    torch_error = relative_error(eager.grad, ref.grad)
    assert relative_error(ours.grad, ref.grad) <= 2 * torch_error + 1e-12, (relative_error(ours.grad, ref.grad),
                                                                              torch_error)
    assert abs(loss.item() - F.cross_entropy(x64, target).item()) <= 1e-6 * max(1.0, abs(loss.item()))


@pytest.mark.parametrize("kind", ["pm1e4", "offset1e4"])
def test_linear_cross_entropy_fp32_gradient_is_as_precise_as_torch_for_large_logits(kind, monkeypatch):
    monkeypatch.setitem(lce_module.TUNING, "chunk_rows", 16)  # several chunks
    n, hidden_size, vocab = 37, 33, 1029
    h64 = torch.randn(n, hidden_size, dtype=torch.float64).float().double()
    w64 = torch.randn(vocab, hidden_size, dtype=torch.float64)
    # weights scaled so that the logits span +-1e4 (or sit around +1e4 through a bias)
    bias64 = None
    if kind == "pm1e4":
        w64 = w64 * (1e4 / 3 / hidden_size**0.5)
    else:
        w64 = w64 * (3 / hidden_size**0.5)
        bias64 = torch.full((vocab,), 1e4, dtype=torch.float64)
    w64 = w64.float().double()
    target = _target(n, vocab)

    def grads(h, w, b, fn):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        fn(h, w, b).backward()
        return h.grad, w.grad

    torch_fn = lambda h, w, b: F.cross_entropy(F.linear(h, w, b), target)
    ref = grads(h64, w64, bias64, torch_fn)
    eager = grads(h64.float(), w64.float(), None if bias64 is None else bias64.float(), torch_fn)
    ours = grads(h64.float(), w64.float(), None if bias64 is None else bias64.float(),
                 lambda h, w, b: linear_cross_entropy(h, w, target, b))
    for mine, theirs, exact in zip(ours, eager, ref):
        assert relative_error(mine, exact) <= 2 * relative_error(theirs, exact) + 1e-12


# ---- 2. fp16 with a loss scale (item 2) -----------------------------------------------------------------
def test_cross_entropy_fp16_gradient_does_not_underflow_before_the_loss_scale():
    # at the N=2048, V=4096, 62% of the entries were 0; at N=128 an fp16 gradient divided by N before the
    # scale still loses 14% of them (and the rest to 1e-4 relative), and the interpreter runs 128 rows, not 2048
    n, vocab, scale = 128, 4096, 65536.0
    torch.manual_seed(0)
    logits = (torch.randn(n, vocab) * 2).half()
    target = torch.randint(0, vocab, (n,))
    ours = logits.clone().requires_grad_()
    (cross_entropy(ours, target) * scale).backward()
    hf = logits.clone().requires_grad_()  # transformers' ForCausalLMLoss: upcast to fp32, then the loss
    (F.cross_entropy(hf.float(), target) * scale).backward()
    zero_ours, zero_hf = (ours.grad == 0).float().mean().item(), (hf.grad == 0).float().mean().item()
    assert abs(zero_ours - zero_hf) < 1e-4, (zero_ours, zero_hf)
    assert relative_error(ours.grad, hf.grad) < 2e-3


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_fp16_gradients_with_a_grad_scaler_factor(reduction, monkeypatch):
    monkeypatch.setitem(lce_module.TUNING, "chunk_rows", 32)
    # mean: entries of p / N down to ~1e-9, below fp16's smallest subnormal unless the scale comes first
    n, hidden_size, vocab = 129, 48, 20011  # 4 chunks of 32 rows and a partial one
    scale = 32768.0 if reduction == "mean" else 8.0  # a sum's gradient is N times larger: it would overflow
    h = (torch.randn(n, hidden_size) * 0.5).half()
    w = (torch.randn(vocab, hidden_size) * 0.3).half()
    target = _target(n, vocab)
    ours = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    (linear_cross_entropy(*ours, target, reduction=reduction) * scale).backward()
    hf = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    (F.cross_entropy(F.linear(*hf).float(), target, reduction=reduction) * scale).backward()
    for mine, theirs in zip(ours, hf):
        assert mine.grad.dtype == torch.float16
        assert torch.isfinite(mine.grad).all() and torch.isfinite(theirs.grad).all()
        assert abs((mine.grad == 0).float().mean().item() - (theirs.grad == 0).float().mean().item()) < 1e-3
        assert relative_error(mine.grad, theirs.grad) < 5e-3


def test_tiny_model_fp16_autocast_with_grad_scaler_matches_unpatched():
    """fp32 master weights, fp16 autocast and torch.amp.GradScaler: the usual fp16 recipe."""
    def step(patched):
        # an 8192 vocabulary: gradient entries p / N of ~1e-6 and below, which fp16 loses without the scale
        model = _tiny_llama(patched, vocab_size=8192)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        ids = torch.randint(0, 8192, (2, 17), generator=torch.Generator().manual_seed(5))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss, grads = step(True)
    ref_loss, ref_grads = step(False)
    assert abs(loss.item() - ref_loss.item()) < 2e-3 * abs(ref_loss.item())
    head = "model.embed_tokens.weight"  # tied to lm_head: the loss gradient's first stop
    assert abs((grads[head] == 0).float().mean() - (ref_grads[head] == 0).float().mean()) < 1e-3
    for name, ref in ref_grads.items():
        assert grads[name].dtype == torch.float32, name
        assert relative_error(grads[name], ref) < 3e-2, name


# ---- 3. autocast over fp32 weights (item 1) ------------------------------------------------------------
def test_linear_cross_entropy_under_autocast_runs_bf16_gemms_and_gives_fp32_weight_gradients(monkeypatch):
    monkeypatch.setitem(lce_module.TUNING, "chunk_rows", 16)
    n, hidden_size, vocab = 53, 64, 1031
    h = torch.randn(n, hidden_size)
    w = torch.randn(vocab, hidden_size) * 0.2
    b = torch.randn(vocab) * 0.1
    target = _target(n, vocab)

    def run(fn, autocast):
        leaves = [t.clone().requires_grad_() for t in (h, w, b)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(*leaves)
        loss.backward()
        return loss, [t.grad for t in leaves]

    hf = lambda h, w, b: F.cross_entropy(F.linear(h, w, b).float(), target)  # nn.Linear + HF's fp32 loss
    ours_loss, ours = run(lambda h, w, b: linear_cross_entropy(h, w, target, b), True)
    hf_loss, hf_grads = run(hf, True)
    fp32_loss, fp32_grads = run(hf, False)
    for g, ref in zip(ours, hf_grads):
        assert g.dtype == torch.float32 and ref.dtype == torch.float32
    # the same numbers as HF under autocast, and measurably not the fp32 computation's
    assert abs(ours_loss.item() - hf_loss.item()) < 1e-5 * abs(hf_loss.item())
    assert abs(hf_loss.item() - fp32_loss.item()) > 1e-4 * abs(hf_loss.item())
    (dh, dw, db), (hf_dh, hf_dw, hf_db), (_, fp32_dw, fp32_db) = ours, hf_grads, fp32_grads
    assert relative_error(dh, hf_dh) < 1e-6
    # weight and bias gradients: bf16 operands as HF's, but summed in fp32 over all rows where HF's output
    # is rounded to bf16 once: never further from the fp32 computation than HF's
    assert relative_error(dw, fp32_dw) <= relative_error(hf_dw, fp32_dw)
    assert relative_error(db, fp32_db) <= relative_error(hf_db, fp32_db)


def test_tiny_llama_every_switch_under_cpu_autocast_matches_unpatched():
    def step(patched):
        model = _tiny_llama(patched)
        ids = torch.randint(0, 301, (2, 17), generator=torch.Generator().manual_seed(2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss, grads = step(True)
    ref_loss, ref_grads = step(False)
    assert abs(loss.item() - ref_loss.item()) < 5e-3 * abs(ref_loss.item())
    for name, ref in ref_grads.items():
        assert grads[name].dtype == torch.float32, name
        # bf16 GEMMs on both sides; foak rounds fewer intermediates (fused ops), so allow bf16-level noise
        assert relative_error(grads[name], ref) < 3e-2, name


# ---- 4. per-class weights (item 8) ---------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_class_weights_match_torch(reduction, label_smoothing, dtype):
    n, vocab = 13, 1029
    logits = (torch.randn(n, vocab) * 3).to(dtype)
    target = _target(n, vocab)
    weight = torch.rand(vocab) + 0.25
    upstream = torch.randn(n) if reduction == "none" else torch.tensor(1.7)
    ours = logits.clone().requires_grad_()
    out = cross_entropy(ours, target, weight=weight, reduction=reduction, label_smoothing=label_smoothing)
    out.backward(upstream)
    ref = logits.double().requires_grad_()
    expected = F.cross_entropy(ref, target, weight=weight.double(), reduction=reduction,
                               label_smoothing=label_smoothing)
    expected.backward(upstream.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert relative_error(out, expected) < tol
    assert relative_error(ours.grad, ref.grad) < tol
    assert relative_error(cross_entropy_reference(logits, target, weight=weight, reduction=reduction,
                                                  label_smoothing=label_smoothing), expected) < tol


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_class_weights_match_torch(reduction, monkeypatch):
    monkeypatch.setitem(lce_module.TUNING, "chunk_rows", 16)
    n, hidden_size, vocab = 41, 24, 517
    h, w = torch.randn(n, hidden_size), torch.randn(vocab, hidden_size) * 0.3
    target = _target(n, vocab)
    class_weight = torch.rand(vocab) + 0.5
    upstream = torch.randn(n) if reduction == "none" else torch.tensor(1.0)
    ours = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    linear_cross_entropy(*ours, target, class_weight=class_weight, reduction=reduction,
                         label_smoothing=0.1).backward(upstream)
    ref = [h.double().requires_grad_(), w.double().requires_grad_()]
    F.cross_entropy(F.linear(*ref), target, weight=class_weight.double(), reduction=reduction,
                    label_smoothing=0.1).backward(upstream.double())
    for mine, theirs in zip(ours, ref):
        assert relative_error(mine.grad, theirs.grad) < 1e-5


def test_class_weight_errors_are_clear():
    logits, target = torch.randn(5, 11), torch.randint(0, 11, (5,))
    with pytest.raises(ValueError, match=r"weight must have shape \(11,\)"):
        cross_entropy(logits, target, weight=torch.ones(10))
    with pytest.raises(ValueError, match="z-loss"):
        cross_entropy(logits, target, weight=torch.ones(11), lse_square_scale=1e-3)
    with pytest.raises(ValueError, match="floating-point"):
        cross_entropy(logits, target, weight=torch.ones(11, dtype=torch.long))
    with pytest.raises(ValueError, match="accum_dtype"):
        linear_cross_entropy(torch.randn(5, 4), torch.randn(11, 4), target, accum_dtype=torch.float16)
    with pytest.raises(ValueError, match="precompute_row_grad applies to reduction='none'"):
        linear_cross_entropy(torch.randn(5, 4), torch.randn(11, 4), target, precompute_row_grad=True)


# ---- 5. token accuracy and entropy (item 8, what TRL logs) ---------------------------------------------
def _torch_stats(z, target):
    valid = target != -100
    log_p = torch.log_softmax(z.double(), -1)
    correct = (z.argmax(-1) == target) & valid  # argmax: the first maximum
    entropy = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    return correct.double(), entropy


@pytest.mark.parametrize("vocab", [1029, 20011])
def test_cross_entropy_token_accuracy_and_entropy(vocab):
    n = 37 if vocab < 5000 else 7
    logits = torch.randn(n, vocab) * 2
    target = _target(n, vocab)
    # ties: a copy of the maximum after the target (counts as correct) and before it (does not)
    for row, before in ((1, False), (2, True)):
        top = int(logits[row].argmax())
        other = min(top + 3, vocab - 1) if not before else max(top - 3, 0)
        target[row] = other if before else top
        logits[row, other] = logits[row, top]
        if before:
            target[row] = top
    softcap, scaling = 4.0, 0.8
    z = softcap * torch.tanh(logits / scaling / softcap)
    correct, entropy = _torch_stats(z, target)
    _, acc, ent = cross_entropy(logits, target, reduction="none", softcap=softcap, logits_scaling=scaling,
                                return_token_accuracy=True, return_entropy=True)
    assert torch.equal(acc.double(), correct)
    assert relative_error(ent, entropy) < 1e-5
    loss, z_loss, acc_mean, ent_mean = cross_entropy(logits.requires_grad_(), target, return_z_loss=True,
                                                     return_token_accuracy=True, return_entropy=True)
    correct, entropy = _torch_stats(logits.detach(), target)
    valid = (target != -100).sum()
    assert abs(acc_mean.item() - correct.sum().item() / valid) < 1e-6
    assert abs(ent_mean.item() - entropy.sum().item() / valid) < 1e-5
    assert not acc_mean.requires_grad and not ent_mean.requires_grad
    assert abs(loss.item() - F.cross_entropy(logits.detach(), target).item()) < 1e-5


def test_linear_cross_entropy_token_accuracy_and_entropy(monkeypatch):
    monkeypatch.setitem(lce_module.TUNING, "chunk_rows", 16)
    n, hidden_size, vocab = 45, 16, 389
    h, w = torch.randn(n, hidden_size), torch.randn(vocab, hidden_size)
    target = _target(n, vocab)
    target[3:9] = (h[3:9] @ w.t()).argmax(-1)  # some correct predictions
    correct, entropy = _torch_stats(h @ w.t(), target)
    loss, acc, ent = linear_cross_entropy(h, w, target, reduction="none", return_token_accuracy=True,
                                          return_entropy=True)
    assert torch.equal(acc.double(), correct) and correct.sum() >= 6
    assert relative_error(ent, entropy) < 1e-5
    ref = linear_cross_entropy_reference(h, w, target, reduction="none", return_token_accuracy=True,
                                         return_entropy=True)
    assert torch.equal(ref[1], acc) and relative_error(ref[2], ent) < 1e-5


# ---- 6. fp32 accumulation of a bf16 weight's gradient (item 8) -----------------------------------------
def test_linear_cross_entropy_accum_dtype_fp32_is_more_precise_for_bf16_weights(monkeypatch):
    monkeypatch.setitem(lce_module.TUNING, "chunk_rows", 8)  # 16 chunks of accumulation
    n, hidden_size, vocab = 128, 32, 257
    h = torch.randn(n, hidden_size).bfloat16()
    w = (torch.randn(vocab, hidden_size) * 0.3).bfloat16()
    target = torch.randint(0, vocab, (n,))
    ref_w = w.double().requires_grad_()
    F.cross_entropy(F.linear(h.double(), ref_w), target, reduction="sum").backward()
    errors = {}
    for accum in (None, torch.float32):
        ours = w.clone().requires_grad_()
        linear_cross_entropy(h, ours, target, reduction="sum", accum_dtype=accum).backward()
        assert ours.grad.dtype == torch.bfloat16
        errors[accum] = relative_error(ours.grad, ref_w.grad)
    assert errors[torch.float32] < 0.7 * errors[None], errors
    assert errors[torch.float32] < 5e-3


# ---- 7. per-token losses with a shared incoming gradient (TRL) ----------------------------------------
def test_precompute_row_grad_uniform_and_non_uniform_incoming_gradients(monkeypatch):
    monkeypatch.setitem(lce_module.TUNING, "chunk_rows", 16)
    calls = []
    real = lce_module._backward_op
    monkeypatch.setattr(lce_module, "_backward_op", lambda *a: (calls.append(1), real(*a))[1])
    n, hidden_size, vocab = 37, 24, 301
    h, w = torch.randn(n, hidden_size), torch.randn(vocab, hidden_size) * 0.5
    target = _target(n, vocab)
    valid = target != -100

    def grads(upstream, **kw):
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        rows = linear_cross_entropy(*leaves, target, reduction="none", **kw)
        rows.backward(upstream)
        return [t.grad for t in leaves]

    uniform = torch.where(valid, -0.125, 3.0)  # ignored rows' gradients do not matter
    ref = grads(uniform)
    assert len(calls) == 1  # the plain "none" path: one backward pass
    got = grads(uniform, precompute_row_grad=True)
    assert len(calls) == 1  # computed in the forward, rescaled in the backward
    for a, b in zip(got, ref):
        assert relative_error(a, b) < 1e-6
    non_uniform = torch.randn(n)
    ref = grads(non_uniform)
    got = grads(non_uniform, precompute_row_grad=True)
    assert len(calls) == 3  # the broken promise is detected and the gradient recomputed exactly
    for a, b in zip(got, ref):
        assert relative_error(a, b) < 1e-6


def test_under_autocast_projections_share_one_cast_of_the_block_input():
    """fp32 weights + autocast: HF's q, k, v (and gate, up) each cast and save their own bf16 copy of the
    norm output; the patched attention and MLP save one copy each (foak.patching.autocast)."""
    SEQ = 11

    def saved_input_copies(patched):
        model = _tiny_llama(patched)
        ids = torch.randint(0, 301, (2, SEQ), generator=torch.Generator().manual_seed(2))
        copies = set()

        def pack(t):
            if t.dtype == torch.bfloat16 and t.numel() == 2 * SEQ * 64 and t.shape[-1] == 64:
                copies.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return len(copies)

    # per layer HF keeps 5 copies of the norm outputs (q, k, v, gate, up) + o_proj's input; the final norm's
    # copy for lm_head: 2 * 6 + 1. foak: 2 per layer + o_proj's input; the fused loss keeps none.
    assert saved_input_copies(False) == 13
    assert saved_input_copies(True) == 6


def test_fused_loss_report_row_says_when_a_training_forward_brings_no_labels():
    import foak

    model = _tiny_llama(False)
    report = foak.patch(model, fused_linear_loss=True)
    row = report.result("llama.fused_linear_loss")
    ids = torch.randint(0, 301, (2, 11))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert "without labels" not in str(report)
    for _ in range(2):  # e.g. HF Trainer's label smoother: logits out, the loss computed outside
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert "2 training forwards without labels computed logits" in row.notes
    assert "without labels" in str(report)
    with torch.no_grad():
        model(input_ids=ids)  # evaluation is not counted
    assert "2 training forwards" in row.notes
