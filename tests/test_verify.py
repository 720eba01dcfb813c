"""foak verify (foak.verify.verify_model): a zeroed norm-weight gradient fails the bf16 check (per parameter, not
pooled); fast_moe, fused_lora (on a LoRA copy with non-zero adapters) and fast_packed_attention (on a packed
batch whose unpatched reference keeps the sequences apart) are checked and their fused calls counted; a fused
path that never ran fails the row; what is not checked is named. Tiny models, one or two rules per test (the
full default run is tests/test_dispatch_and_compile.py's CLI test)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from foak.cli import main
from foak.models.tiny import tiny_model
from foak.testing import relative_error
from foak.verify import format_report, lora_model, packed_batch, switches_to_check, verify_model

verify = importlib.import_module("foak.verify")
rms_norm_op = importlib.import_module("foak.ops.rms_norm")  # the module (foak.ops.rms_norm is also the function)


def test_bf16_verify_fails_when_the_norm_weight_gradients_are_zero(monkeypatch, capsys):
    argv = ["verify", "--arch", "llama", "--dtype", "bfloat16", "--rules", "rms_norm"]
    launch = rms_norm_op._backward_launch

    def zero_weight_gradient(*args, **kwargs):  # the planted bug: dx right, dw zero
        dx, dw = launch(*args, **kwargs)
        return dx, torch.zeros_like(dw)

    monkeypatch.setattr(rms_norm_op, "_backward_launch", zero_weight_gradient)
    assert main(argv) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("rms_norm "))
    # the worst parameter is a norm weight, its gradient error 1 (zero), against a bound far below it
    assert "layernorm.weight" in row or "norm.weight" in row, row
    assert " 1.0e+00 " in row and row.endswith("FAIL"), row
    assert "verify: FAIL: 0 of 1 checks passed; failed: rms_norm (model, padded)" in out
    monkeypatch.undo()  # the kernel as it is passes the same check
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "verify: PASS: 1 of 1 checks passed" in out and "bound = max(8 x the unpatched bfloat16" in out


def test_verify_checks_fast_moe_and_counts_its_calls():
    assert "moe" in switches_to_check(tiny_model("mixtral"))[0]  # part of the default run
    assert switches_to_check(tiny_model("mixtral"), ["fast_moe"])[0] == ["moe"]  # the config key names it too
    with pytest.raises(ValueError, match=r"\['moe'\] not available for llama"):
        switches_to_check(tiny_model("llama"), ["moe"])
    report = verify_model(tiny_model("mixtral"), ["moe"])
    (row,) = report.rows
    assert (row.name, row.model_kind, row.batch_kind, row.modules) == ("moe", "model", "padded", 2)
    assert row.calls == {"moe": (2, {})}  # foak's experts op ran in both MoE layers, nothing fell back
    assert row.passed and row.loss_error <= 1e-5 and row.grad_error <= 1e-5
    assert "moe 2/2" in format_report(report)


def test_verify_checks_fused_lora_and_fails_a_fused_path_that_never_ran():
    base = tiny_model("llama")
    lora = lora_model(base)
    batch = {"input_ids": torch.arange(1, 9)[None], "labels": torch.arange(1, 9)[None]}
    assert abs(lora(**batch).loss.item() - base(**batch).loss.item()) > 1e-3  # the adapters change the model
    report = verify_model(base, ["lora"])
    (row,) = report.rows
    assert (row.name, row.model_kind, row.batch_kind, row.modules) == ("lora", "LoRA", "padded", 16)
    assert row.calls == {"lora": (14, {})}  # 7 projections x 2 layers, all fused
    assert row.passed and row.grad_error <= 1e-5 and ".lora_" in row.worst_param
    # a trainable base weight sends every call to PEFT's own forward: checked, but the row fails
    for name, p in lora.named_parameters():
        if name.endswith("base_layer.weight"):
            p.requires_grad_(True)
    (row,) = verify_model(lora, ["lora"]).rows
    assert row.calls == {"lora": (0, {"trainable base layer": 14})}
    assert not row.passed and row.grad_error <= 1e-5  # the numbers agree (PEFT's path ran on both sides)
    assert row.problems == ["lora: the fused path never ran (trainable base layer (14))"]


def test_verify_checks_packed_attention_on_a_packed_batch():
    model = tiny_model("llama")
    batch = packed_batch(model.config.vocab_size)
    # the reference: transformers' own packed forward keeps the sequences apart (each sequence run alone)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        for r, lengths in enumerate(((5, 1, 4, 3), (6, 7))):
            start = 0
            for n in lengths:
                alone = model(input_ids=batch["input_ids"][r:r + 1, start:start + n], use_cache=False).logits
                assert relative_error(logits[r:r + 1, start:start + n], alone) < 1e-5
                start += n
    report = verify_model(model, ["packed_attention"])
    (row,) = report.rows
    assert (row.name, row.batch_kind, row.modules) == ("packed_attention", "packed", 1)
    assert row.calls == {"packed_attention": (2, {})}  # both layers attended per sequence through foak
    assert row.passed and row.grad_error <= 1e-5


def test_verify_names_what_it_did_not_check(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    report = verify_model(tiny_model("llama"), ["lora", "packed_attention"])
    assert [r.name for r in report.rows] == ["packed_attention"] and report.passed
    assert report.skipped["lora"].startswith("peft is not installed")
    assert report.skipped["rms_norm"] == "not requested (--rules)"
    text = format_report(report)
    assert "not checked: lora (fused_lora): peft is not installed" in text
    assert "no rule for this architecture: fast_moe" in text
    assert text.splitlines()[-1] == ("verify: PASS: 1 of 1 checks passed; 8 rules not checked: fused_linear_loss, "
                                     "loss, offload_activations, rms_norm, rope, swiglu, tiled_mlp, lora")
    # a rule that patches nothing is named with the report's reason; nothing checked at all is an error
    model = tiny_model("llama")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"nothing could be checked: packed_attention \(fast_packed_attention\): "
                                         r"patched no module .*'flex_attention'"):
        verify_model(model, ["packed_attention"])


def test_verify_checks_offload_activations_and_fails_when_nothing_was_offloaded(monkeypatch):
    # before: offload_activations (foak train --long_context's) was "not available for llama" under --rules and
    # named nowhere in a default run. Its row runs the patched copy with gradient checkpointing in training mode
    report = verify_model(tiny_model("llama"), ["offload_activations"])
    [row] = report.rows
    assert (row.name, row.batch_kind, row.calls_text) == ("offload_activations", "padded", "offload_activations 2/2")
    assert row.passed and row.loss_error <= 1e-5 and row.grad_error <= 1e-5, row
    assert "2 of 2 checkpointed layers' inputs offloaded" in row.notes
    # no checkpointing, so nothing offloaded: the numbers match, the row fails
    monkeypatch.setattr(verify, "_checkpointed_training", lambda model: None)
    [row] = verify_model(tiny_model("llama"), ["fast_rms_layernorm", "offload_activations"]).rows[:1]
    assert row.name == "offload_activations" and not row.passed and row.grad_error <= 1e-5, row
    assert row.problems == ["offload_activations: no layer's input was offloaded (no checkpointed layer ran)"]
    # a setting is not a rule: said so, not "not available"
    with pytest.raises(ValueError, match=r"\['cudnn_attention'\] is a setting of a rule, not a rule switch: foak "
                                         r"verify does not check it"):
        verify_model(tiny_model("llama"), ["cudnn_attention"])


def test_fp64_arbiter_passes_rounding_sensitive_gradients_and_fails_wrong_ones():
    """fp32: a gradient over 1e-5 vs the unpatched model passes only when it is as near the fp64 gradient as
    the unpatched model's own fp32 run and its rounding-moved copies are (x FP64_ARBITER_FACTOR)."""
    from foak.verify import FP64_ARBITER_FACTOR, _compare

    exact_grad = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)
    hf = exact_grad.float() * (1 + 4e-5)  # transformers' fp32: 4e-5 from fp64 (an ill-conditioned gradient)
    moved = exact_grad.float() * (1 - 6e-5)  # a rounding-moved copy: 6e-5
    exact = lambda: (torch.tensor(1.0, dtype=torch.float64), {"w": exact_grad}, [{"w": moved}])
    ref = (torch.tensor(1.0), {"w": hf})
    near = (torch.tensor(1.0), {"w": exact_grad.float() * (1 - 1e-4)})  # 1.4e-4 from hf, 1e-4 from fp64
    _, _, err, bound, name, arbitrated = _compare(near, ref, None, torch.float32, exact)
    assert arbitrated == 1 and name == "w" and err <= bound == pytest.approx(FP64_ARBITER_FACTOR * 6e-5, rel=1e-3)
    far = (torch.tensor(1.0), {"w": exact_grad.float() * (1 - 3e-4)})  # 3e-4 from fp64: beyond 3 x 6e-5
    _, _, err, bound, _, _ = _compare(far, ref, None, torch.float32, exact)
    assert err > bound
    zero = (torch.tensor(1.0), {"w": torch.zeros(4)})
    _, _, err, bound, _, _ = _compare(zero, ref, None, torch.float32, exact)
    assert err == pytest.approx(1.0) and bound < 1e-3
    _, _, err, bound, _, arbitrated = _compare(near, ref, None, torch.float32, None)  # no arbiter: 1e-5
    assert arbitrated == 0 and err > bound == 1e-5
