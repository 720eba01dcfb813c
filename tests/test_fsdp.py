"""foak's patched models under DDP and FSDP2, on CPU: two gloo processes (one spawn for every check, see
tests/distributed_utils.py) against one process, fp32.

Each rank trains its half of a global batch for two SGD steps (one for the Triton case); the one-process
reference trains the whole batch (every row has the same number of targets, so the mean of the ranks' mean
losses is the batch's mean and the ranks' averaged gradients are its gradient). Checked per case: the loss
of both steps and every trainable parameter's gradient of the first step (FSDP2: gathered with
``full_tensor``) within 1e-5 relative of the unpatched one-process model, for the patched and the unpatched
distributed model; and that foak's rules ran (the fused loss inside the LM head's forward on the gathered
weight, fused_lora's fused calls; its PEFT-path calls where FSDP wrapped a LoRA layer's linears).

Backend: the ranks run foak's Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets and the forked ranks inherit: it runs across processes) for the FSDP2 Llama case with
reshard_after_forward (RMSNorm, SwiGLU, the fused loss; one step, one row per rank), and foak's torch reference
ops for the others (the interpreter's seconds per step would take the file past its minute); each case
records the backend the patch report names and the test checks it.

Cases: a tiny Llama (hidden 64, 2 layers, vocab 301): DDP; FSDP2 with each decoder layer, the [final norm,
lm_head] unit and the root sharded (accelerate's layout), reshard_after_forward True and False for the layers
and the head's unit (True frees the head between its forward and the backward: the fused loss must read it
inside the head's forward), a MixedPrecisionPolicy with fp32 params and bf16 params (the latter against the
unpatched model under the same policy, both against fp32); patched after fully_shard instead of before. A
tiny PEFT LoRA Llama (fused_lora; also with every LoRA layer's base and adapter linears FSDP units of their
own), a LoRA Llama on a GPTQ-4bit base (foak.quant) and on a bitsandbytes NF4
base (its Params4bit kept out of sharding, quant_state intact), a tiny Mixtral (fast_moe, tied embeddings).
Where bitsandbytes' CPU dequantization is wrong (bitsandbytes 0.50.2 on AVX-512 CPUs, foak.patching.bnb_cpu), the
ranks run it as the NF4 formula (foak.testing.bitsandbytes_dequant_by_formula)."""

from __future__ import annotations

import copy
import time
import traceback

import pytest
import torch

from distributed_utils import run_ranks

WORLD = 2
ROWS, SEQ = 2, 13  # per rank
LR = 0.1
TOL = 1e-5

# name -> (model kind, wrapper, options); wrapper: "ddp" or "fsdp"
CASES = {
    "llama_ddp": ("llama", "ddp", {}),
    "llama_fsdp_reshard": ("llama", "fsdp", {"reshard": True}),
    "llama_fsdp_no_reshard": ("llama", "fsdp", {"reshard": False}),
    "llama_fsdp_mp_fp32": ("llama", "fsdp", {"reshard": True, "param_dtype": torch.float32}),
    "llama_fsdp_patched_after": ("llama", "fsdp", {"reshard": True, "patch_after": True}),
    "llama_fsdp_mp_bf16": ("llama", "fsdp", {"reshard": True, "param_dtype": torch.bfloat16}),
    "lora_fsdp": ("lora", "fsdp", {"reshard": True}),
    "lora_ddp": ("lora", "ddp", {}),
    # LoRA layers whose base and adapter linears are FSDP units of their own (size-based wrapping, FSDP1-style
    # policies): fused_lora must not bypass their gathering forwards, so every call takes PEFT's path
    "lora_fsdp_wrapped_sublayers": ("lora", "fsdp", {"reshard": True, "wrap_sublayers": True}),
    "gptq_lora_fsdp": ("gptq", "fsdp", {"reshard": True}),
    "nf4_lora_fsdp": ("nf4", "fsdp", {"reshard": True}),
    "mixtral_fsdp": ("mixtral", "fsdp", {"reshard": True}),
}
# run in Triton's interpreter, without the RoPE kernel (it reads no weight, and its interpreted programs would
# take half the case's time; the reference cases run it)
# with one row per rank and one step (the interpreter's seconds per step)
TRITON_CASES = {"llama_fsdp_reshard"}


_BUILT: dict = {}


def _build(kind):
    """A fresh copy of the model of a case, identical on every rank (seeded), in train mode, and its switches."""
    if kind not in _BUILT:
        _BUILT[kind] = _make(kind)
    model, switches = _BUILT[kind]
    return copy.deepcopy(model), dict(switches)


def _make(kind):
    import peft

    from foak.models.tiny import tiny_config, tiny_model

    switches = dict(fast_rms_layernorm=True, fast_rope_embeddings=True, fast_swiglu=True, fused_linear_loss=True)
    if kind == "mixtral":
        import transformers

        config = tiny_config("mixtral")
        config.tie_word_embeddings, config.output_router_logits = True, False
        torch.manual_seed(3)
        model = transformers.AutoModelForCausalLM.from_config(config).float()
        model.tie_weights()
        switches = dict(fast_rms_layernorm=True, fast_rope_embeddings=True, fast_moe=True, fused_linear_loss=True)
    else:
        model = tiny_model("llama", seed=1)
    if kind in ("lora", "gptq", "nf4"):
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
        if kind == "gptq":
            from foak.quant import quantize_model_gptq
            from foak.quant.gptq_peft import register_gptq_lora

            model = quantize_model_gptq(model, group_size=32)
            register_gptq_lora(config)
        if kind == "nf4":
            model = _quantize_nf4(model)
        torch.manual_seed(4)
        model = peft.get_peft_model(model, config)
        for name, p in model.named_parameters():  # PEFT's lora_B starts at 0: make every gradient non-trivial
            if "lora_B" in name:
                with torch.no_grad():
                    p.normal_(0, 0.1)
        switches["fused_lora"] = True
    model.train()
    return model, switches


def _quantize_nf4(model):
    from foak.bench.step import quantize_nf4

    return quantize_nf4(model, "cpu", torch.float32)


def _batches(vocab, world, rows, steps):
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(0, vocab, (rows * world, SEQ), generator=gen) for _ in range(steps)]


def _train(model, batches, params, grads_of):
    """Two SGD steps; (losses, first step's gradients by name)."""
    optimizer = torch.optim.SGD([p for _, p in params], lr=LR)
    losses, grads = [], None
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if grads is None:
            grads = grads_of()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    return losses, grads


def _trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _one_process(kind, patched, batches, switches):
    import foak

    model, _ = _build(kind)
    if patched:
        foak.patch(model, **switches)
    params = _trainable(model)
    return _train(model, batches, params, lambda: {n: p.grad.clone() for n, p in params})


def _distributed(kind, wrapper, options, patched, batches, switches, rank, world, mesh):
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import foak
    from foak.integrations.accelerate import fsdp2_ignored_params, shard_model

    model, _ = _build(kind)
    rows = batches[0].shape[0] // world
    local = [ids[rank * rows:(rank + 1) * rows] for ids in batches]
    report = None
    ignored_before = {id(p): (p.quant_state, p.data.clone()) for p in fsdp2_ignored_params(model)}
    if patched and not options.get("patch_after"):
        report = foak.patch(model, **switches)
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        run = DistributedDataParallel(model)
        params = _trainable(run.module)
    else:
        policy = MixedPrecisionPolicy(param_dtype=options.get("param_dtype"), reduce_dtype=torch.float32) \
            if "param_dtype" in options else None
        if options.get("wrap_sublayers"):
            from peft.tuners.lora import LoraLayer
            from torch.distributed.fsdp import fully_shard

            for layer in [m for m in model.modules() if isinstance(m, LoraLayer)]:
                for sub in (layer.base_layer, layer.lora_A["default"], layer.lora_B["default"]):
                    fully_shard(sub, mesh=mesh, reshard_after_forward=True)
        run = shard_model(model, mesh=mesh, reshard_after_forward=options["reshard"],
                          head_reshard_after_forward=options["reshard"], mp_policy=policy)
        params = _trainable(model)
    if patched and options.get("patch_after"):
        report = foak.patch(model, **switches)

    def grads_of():
        return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone() for n, p in params}

    losses, grads = _train(run, local, params, grads_of)
    for loss in losses:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    out = {"losses": losses, "grads": grads}
    if wrapper == "fsdp":
        from torch.distributed.tensor import DTensor

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        out["head_is_dtensor"] = isinstance(base.lm_head.weight, DTensor)
        out["params4bit"] = [(type(p).__name__, p.quant_state is ignored_before[id(p)][0],
                              torch.equal(p.data, ignored_before[id(p)][1]), p.dtype)
                             for p in model.parameters() if id(p) in ignored_before]
    if report is not None:
        out["report"] = str(report)
        out["backends"] = sorted({r.backend for r in report.results if r.modules})
        from foak.patching.peft import fused_lora_counts

        out["fused_lora"] = [fused_lora_counts(report, r.rule_id) for r in report.results
                             if r.rule_id.endswith(".fused_lora")]
    return out


_LCE_CALLS: list = []


def _record_fused_loss_calls():
    """Wrap the fused loss rule's linear_cross_entropy: which weight type each call received."""
    from foak.patching import replacements

    original = replacements.linear_cross_entropy

    def recording(hidden, weight, *args, **kwargs):
        _LCE_CALLS.append(type(weight).__name__)
        return original(hidden, weight, *args, **kwargs)

    replacements.linear_cross_entropy = recording


def _dtensor_guard(mesh):
    """What foak's ops say when handed a sharded DTensor instead of a gathered tensor."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import foak

    weight = distribute_tensor(torch.ones(6), mesh, [Shard(0)])
    messages = {}
    for backend in ("auto", "reference"):
        foak.set_backend(backend)
        try:
            foak.rms_norm(torch.randn(3, 6), weight, 1e-6)
            messages[backend] = None
        except ValueError as e:
            messages[backend] = str(e)
    foak.set_backend("auto")
    return messages


def _rank_main(rank, world):
    from foak.testing import bitsandbytes_dequant_by_formula

    # the NF4 case's unpatched models compute with bitsandbytes' CPU dequantization: the NF4 formula's where
    # bitsandbytes' own is wrong on this CPU (foak.patching.bnb_cpu; foak's fused path never calls it)
    with bitsandbytes_dequant_by_formula():
        return _run_cases(rank, world)


def _run_cases(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from foak.backend import set_backend

    mesh = init_device_mesh("cpu", (world,))
    _record_fused_loss_calls()
    results = {}
    for name, (kind, wrapper, options) in CASES.items():
        start = time.perf_counter()
        model, switches = _build(kind)
        small = name in TRITON_CASES
        batches = _batches(model.config.vocab_size, world, 1 if small else ROWS, 1 if small else 2)
        ref_key = (kind, "ref", small)
        if ref_key not in results:
            set_backend("reference")
            results[ref_key] = _one_process(kind, False, batches, switches)
        set_backend("auto" if small else "reference")
        _LCE_CALLS.clear()
        try:
            patched = _distributed(kind, wrapper, options, True, batches, switches, rank, world, mesh)
            patched["lce_weight_types"] = list(_LCE_CALLS)
            unpatched = _distributed(kind, wrapper, options, False, batches, switches, rank, world, mesh)
            results[name] = {"patched": patched, "unpatched": unpatched, "seconds": time.perf_counter() - start}
        except Exception:  # reported by this case's tests (the other cases still run)
            results[name] = {"error": traceback.format_exc(), "seconds": time.perf_counter() - start}
    results["guard"] = _dtensor_guard(mesh)
    results["cpu_seconds"] = time.process_time()
    set_backend("auto")
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # one spawn per test session: under pytest-xdist every worker would build this module fixture itself, so
    # the first worker runs the ranks and the others read its results (a file lock in the shared temp root)
    import os

    from filelock import FileLock

    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one xdist run
    if run_id is None:
        return _spawn(tmp_path_factory)
    shared = tmp_path_factory.getbasetemp().parent / f"fsdp_ranks_results_{run_id}.pt"
    with FileLock(str(shared) + ".lock"):
        if shared.exists():
            return torch.load(shared, weights_only=False)
        results = _spawn(tmp_path_factory)
        torch.save(results, shared)
    return results


def _spawn(tmp_path_factory):
    start = time.perf_counter()
    results = run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("fsdp"), timeout_s=240,
                        preload=("torch", "torch.distributed.fsdp", "transformers", "peft", "foak",
                                 "foak.quant", "bitsandbytes"))
    print(f"\n{WORLD} ranks: {time.perf_counter() - start:.1f} s; per case (rank 0): "
          + ", ".join(f"{n} {r['seconds']:.1f}" for n, r in results[0].items() if n in CASES)
          + f"; CPU seconds of the ranks (imports after the fork included): {[r['cpu_seconds'] for r in results]}")
    return results


def _relative(a, b):
    from foak.testing import relative_error

    return relative_error(a.float(), b.float())


@pytest.mark.parametrize("case", list(CASES))
def test_distributed_matches_one_process(runs, case):
    kind, wrapper, options = CASES[case]
    bf16 = options.get("param_dtype") is torch.bfloat16
    for rank, results in enumerate(runs):
        ref_losses, ref_grads = results[(kind, "ref", case in TRITON_CASES)]
        r = results[case]
        assert "error" not in r, f"rank {rank}: {r['error']}"
        for which in ("patched", "unpatched"):
            run = r[which]
            assert set(run["grads"]) == set(ref_grads) and ref_grads, (rank, which)
            loss_err = max(_relative(a, b) for a, b in zip(run["losses"], ref_losses, strict=True))
            grad_err = {n: _relative(run["grads"][n], g) for n, g in ref_grads.items()}
            worst = max(grad_err, key=grad_err.get)
            if not bf16:
                assert loss_err <= TOL, (rank, which, loss_err)
                assert grad_err[worst] <= TOL, (rank, which, worst, grad_err[worst])
            else:  # bf16 params: foak may add at most 2e-2 to the unpatched model's own error against fp32
                r.setdefault("errors", {})[which] = (loss_err, grad_err)
        if bf16:
            (ul, ug), (pl, pg) = r["errors"]["unpatched"], r["errors"]["patched"]
            assert max(ug.values()) > 1e-3, ug  # the policy did compute in bf16
            assert pl <= ul + 2e-2, (rank, pl, ul)
            for n in ug:
                assert pg[n] <= ug[n] + 2e-2, (rank, n, pg[n], ug[n])


@pytest.mark.parametrize("case", list(CASES))
def test_foak_rules_ran_on_gathered_weights(runs, case):
    kind, wrapper, options = CASES[case]
    for rank, results in enumerate(runs):
        assert "error" not in results[case], f"rank {rank}: {results[case]['error']}"
        patched = results[case]["patched"]
        want = "triton (interpreter) on cpu" if case in TRITON_CASES else "reference on cpu (forced)"
        assert patched["backends"] == [want], (rank, patched["backends"], patched["report"])
        # the fused loss ran once per step, inside lm_head's forward, on the plain gathered weight
        steps = 1 if case in TRITON_CASES else 2
        assert patched["lce_weight_types"] == ["Parameter"] * steps, patched["lce_weight_types"]
        if wrapper == "fsdp":
            assert patched["head_is_dtensor"] and results[case]["unpatched"]["head_is_dtensor"]
        if kind in ("lora", "gptq", "nf4"):
            (fused, peft_path), *_ = patched["fused_lora"]
            if options.get("wrap_sublayers"):  # 14 LoRA layers x 2 steps, each its own FSDP-wrapped forward
                # (the base's class is FSDP's subclass of nn.Linear: no base format foak knows)
                assert fused == 0 and peft_path == {"base layer FSDPLinear": 28}, (fused, peft_path)
            else:
                assert fused > 0 and not peft_path, (rank, fused, peft_path, patched["report"])
        if kind == "nf4":
            # the 4-bit weights stayed out of sharding: bitsandbytes' Params4bit with its own quant_state,
            # bits and storage dtype (no policy cast them)
            kept = patched["params4bit"]
            assert len(kept) == 14 and all(k == ("Params4bit", True, True, torch.uint8) for k in kept), kept


def test_ops_refuse_a_sharded_dtensor(runs):
    for results in runs:
        for backend, message in results["guard"].items():
            assert message is not None, backend
            assert "rms_norm: weight is a DTensor (placements (Shard(dim=0),), local shard (3,) of (6,))" in message
            assert "inside the forward of the module that owns the parameter" in message


# foak train under torchrun -----------------------------------------------------------------------------
def test_foak_train_under_torchrun_ddp(tmp_path):
    """Two CPU processes (accelerate's MULTI_CPU: DDP over gloo; accelerate has no FSDP on CPU): every rank
    patches its model, rank 0 alone prints the report (before and after training) and the summary, whose
    token count is both ranks' (every sequence is truncated to 20 tokens: 2 ranks x 2 steps x 4 x 20)."""
    import json
    import os
    import re
    import subprocess
    import sys

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} " + "abcdefgh" * 4}) + "\n" for i in range(64)))
    env = dict(os.environ, TRITON_INTERPRET="0", FOAK_BACKEND="auto")  # foak's reference ops (CPU)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "foak.cli",
           "train", "--dataset", str(data), "--max_seq_length", "20", "--per_device_train_batch_size", "4",
           "--max_steps", "2", "--logging_steps", "1", "--output_dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    if proc.returncode != 0 and "exitcode: -6" in proc.stderr:
        # seen once in ~8 runs on a loaded 2-core machine: a rank aborted (SIGABRT) while another test's gloo
        # ranks ran beside it; not reproduced alone or under load. One rerun, and the first failure is shown.
        import warnings

        warnings.warn("torchrun rank aborted (exitcode -6); rerunning once. stderr tail: " + proc.stderr[-1500:])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert out.count("foak patch report (llama") == 2 and out.count("after training:") == 1, out
    assert "llama.fused_linear_loss   fused_linear_loss  1        reference on cpu" in out, out
    assert out.count("model: tiny Llama") == 1 and out.count("\ndone: ") == 1, out
    done = re.search(r"\ndone: 2 steps on 2 processes in [\d.]+ s, (\d+) tokens", out)
    assert done is not None and int(done.group(1)) == 2 * 2 * 4 * 20, out
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "out" / "loss_curve.png").exists()
    # the summary's step-1 loss is HF's logged one (every rank's training_step value averaged), not rank 0's
    # share of it (the ranks' texts differ, so their own losses do)
    summary = json.loads((tmp_path / "out" / "train_summary.json").read_text())
    logged = [h["loss"] for h in json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
              if "loss" in h]
    assert len(logged) == 2 and summary["steps"] == 2 and summary["world_size"] == 2, summary
    assert abs(summary["first_loss"] - logged[0]) <= 1e-6 * abs(logged[0]), (summary["first_loss"], logged)
    assert re.search(rf"loss {logged[0]:.3f} \(step 1\) -> {logged[1]:.3f} \(step 2\)", out), (logged, out)
