"""offload_activations under DDP and FSDP2, on CPU: two gloo processes (tests/distributed_utils.py, the harness of
tests/test_fsdp.py), fp32 or FSDP2's bf16 MixedPrecisionPolicy, HF gradient checkpointing on (non-reentrant unless
said), foak's torch reference ops.

Per case, every rank trains its half of a global batch for two SGD steps twice: the same distributed model without
offload_activations and with it (``foak.patch(model, offload_activations=True)``, nothing else patched). Checked:
the loss of both steps and every trainable parameter's gradient of the first step (FSDP2: gathered with
``full_tensor``) bitwise equal to the run without offload (EXACT: offload moves the saved input and brings it back
unchanged; the recompute and the backward are the same ops), fp32 master weights and gradients; and that the layers
were really offloaded: the stack's state (foak.patching.offload.state_of) and the report row say every
checkpointed layer's input went to the host (LoRA: all but layer 0's, a graph leaf; with a budget, the first
offloadable layer's and the later ones kept on the device), one host copy was made per offloaded input and each
was unpacked from the host in the backward in the dtype, shape and device it was saved with (bf16 under the mixed
precision policy; counted in the ranks), and the budget was released after the backward.

Cases: a tiny Llama (2 layers), full fine-tuning and PEFT LoRA, under DDP and under FSDP2 (accelerate's layout:
each decoder layer, the [final norm, lm_head] unit and the root sharded) with reshard_after_forward True (the
recompute runs on parameters gathered again in the backward) and False; patched after fully_shard; reentrant
checkpointing; FSDP2 under MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), the way it is run for
training; and an offload_budget_gib of one layer's input and a half (FSDP2, fp32 and bf16)."""

from __future__ import annotations

import time
import traceback
import weakref

import pytest
import torch

from distributed_utils import run_ranks

WORLD = 2
ROWS, SEQ = 2, 13  # per rank
LR = 0.1
TOL = 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> (lora, wrapper, options)
CASES = {
    "full_ddp": (False, "ddp", {}),
    "lora_ddp": (True, "ddp", {}),
    "full_fsdp_reshard": (False, "fsdp", {"reshard": True}),
    "full_fsdp_no_reshard": (False, "fsdp", {"reshard": False}),
    "full_fsdp_patched_after": (False, "fsdp", {"reshard": True, "patch_after": True}),
    "lora_fsdp_reshard": (True, "fsdp", {"reshard": True}),
    "full_fsdp_reentrant": (False, "fsdp", {"reshard": True, "reentrant": True}),
    "lora_ddp_reentrant": (True, "ddp", {"reentrant": True}),
    # FSDP2 as users run it: bf16 compute, fp32 master weights and gradient reduction (exact: see EXACT)
    "full_fsdp_bf16": (False, "fsdp", {"reshard": True, "bf16": True}),
    "full_fsdp_bf16_no_reshard": (False, "fsdp", {"reshard": False, "bf16": True}),
    "lora_fsdp_bf16": (True, "fsdp", {"reshard": True, "bf16": True}),
    # a budget of one layer's input: the first offloadable layer offloaded, the later ones kept on the device
    # (LoRA: layer 0 is a leaf, layer 1 offloaded: 3 layers so that one is kept; the same batch in both steps, so
    # that the second loss shows the step trained: on this 3-layer model a step does not lower the other batch's)
    "full_fsdp_budget": (False, "fsdp", {"reshard": True, "budget_layers": 1}),
    "lora_fsdp_budget": (True, "fsdp", {"reshard": True, "layers": 3, "budget_layers": 1, "same_batch": True}),
    "full_fsdp_bf16_budget": (False, "fsdp", {"reshard": True, "budget_layers": 1, "bf16": True}),
    "lora_fsdp_bf16_budget": (True, "fsdp", {"reshard": True, "layers": 3, "budget_layers": 1, "bf16": True,
                                             "same_batch": True}),
}
# cases whose loss and gradients must equal the run without offload bitwise (all of them, fp32 and bf16: gloo on
# the CPU reduces deterministically): offload only moves the saved input to the host and brings it back unchanged
# (same dtype, same bytes), and the recompute and backward are the same ops; the others: within TOL
EXACT = set(CASES)
HIDDEN = 64


def _per_layer(options):
    """Bytes of one checkpointed layer's saved input (hidden states [rows, seq, hidden]): bf16 under the mixed
    precision policy (FSDP2 casts the root's inputs, the embedding runs on bf16 weights), else fp32."""
    return ROWS * SEQ * HIDDEN * (2 if options.get("bf16") else 4)


def _build(lora, reentrant=False, layers=None):
    """The tiny Llama (2 layers unless asked) with HF gradient checkpointing (non-reentrant unless asked),
    identical on every rank."""
    from foak.models.tiny import model_from_config, tiny_config

    config = tiny_config("llama")
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(1)
    model = model_from_config(config).float()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if lora:
        import peft

        torch.manual_seed(4)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                           lora_dropout=0.0))
        for name, p in model.named_parameters():  # PEFT's lora_B starts at 0: make every gradient non-trivial
            if "lora_B" in name:
                with torch.no_grad():
                    p.normal_(0, 0.1)
        if reentrant:  # reentrant checkpointing needs an input that requires grad (as HF Trainer sets up)
            model.enable_input_require_grads()
    model.train()
    return model


def _stack(model):
    from foak.patching import offload

    return next(m for m in model.modules() if offload._is_decoder_stack(m, model))


class _Counts:
    """What went through the offload path in a rank: host copies made, inputs brought back from the host."""

    def __init__(self):
        from foak.patching import offload

        self.copies = self.unpacked = 0
        self.budgets = []  # the budgets of the sessions that unpacked an input
        self.packed_dtypes, self.unpacked_dtypes = set(), set()  # of the inputs sent to / brought back from the host
        self.round_trip_changed = 0  # inputs that came back from the host with another dtype, shape or device
        saved = weakref.WeakKeyDictionary()  # handle -> (dtype, shape, device) of the input it offloaded
        real_buffer, real_pack, real_unpack = offload._host_buffer, offload._Session.pack, offload._Session.unpack

        def buffer(like):
            self.copies += 1
            return real_buffer(like)

        def pack(session, t, layer):
            handle = real_pack(session, t, layer)
            if isinstance(handle, offload._Offloaded) and handle.host is not None:
                self.packed_dtypes.add(t.dtype)
                saved[handle] = (t.dtype, tuple(t.shape), t.device)
            return handle

        def unpack(session, handle):
            value = real_unpack(session, handle)
            if isinstance(handle, offload._Offloaded) and handle.host is not None:
                self.unpacked += 1
                self.unpacked_dtypes.add(value.dtype)
                if (value.dtype, tuple(value.shape), value.device) != saved[handle]:
                    self.round_trip_changed += 1
                if not any(b is session.budget for b in self.budgets):
                    self.budgets.append(session.budget)
            return value

        offload._host_buffer, offload._Session.pack, offload._Session.unpack = buffer, pack, unpack

    def reset(self):
        self.copies = self.unpacked = self.round_trip_changed = 0
        self.budgets.clear()
        self.packed_dtypes.clear()
        self.unpacked_dtypes.clear()


def _run(lora, wrapper, options, offloaded, batches, rank, world, mesh, counts):
    import torch.distributed as dist

    import foak
    from foak.integrations.accelerate import shard_model
    from foak.patching import offload

    model = _build(lora, options.get("reentrant", False), options.get("layers"))
    rows = batches[0].shape[0] // world
    local = [ids[rank * rows:(rank + 1) * rows] for ids in batches]
    if options.get("same_batch"):
        local = [local[0]] * len(local)
    report = None
    patch = {"offload_activations": True}
    if "budget_layers" in options:  # room for that many layers' inputs and half of one more
        patch["offload_budget_gib"] = (options["budget_layers"] + 0.5) * _per_layer(options) / 2**30
    if offloaded and not options.get("patch_after"):
        report = foak.patch(model, **patch)
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        run = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if options.get("bf16")
              else None)
        run = shard_model(model, mesh=mesh, reshard_after_forward=options["reshard"],
                          head_reshard_after_forward=options["reshard"], mp_policy=mp)
    if offloaded and options.get("patch_after"):
        report = foak.patch(model, **patch)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.SGD([p for _, p in params], lr=LR)
    stack = _stack(model)
    losses, grads, per_step = [], None, []
    for ids in local:
        counts.reset()
        loss = run(input_ids=ids, labels=ids).loss
        stats = dict(offload.state_of(stack))
        copies = counts.copies
        loss.backward()
        if grads is None:
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for n, p in params}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        per_step.append({"stats": stats, "copies": copies, "unpacked": counts.unpacked,
                         "packed_dtypes": set(counts.packed_dtypes), "unpacked_dtypes": set(counts.unpacked_dtypes),
                         "round_trip_changed": counts.round_trip_changed})
        losses.append(loss.detach().float())
    for loss in losses:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    out = {"losses": losses, "grads": grads, "steps": per_step, "layers": len(stack.layers),
           "param_dtypes": {p.dtype for _, p in params}, "grad_dtypes": {g.dtype for g in grads.values()}}
    if report is not None:
        out["row"] = report.result("llama.offload_activations").notes
        import gc

        gc.collect()
        out["budget_in_use"] = [b.in_use for b in counts.budgets]  # 0 once autograd dropped the handles
    return out


def _rank_main(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import foak

    foak.set_backend("reference")
    mesh = init_device_mesh("cpu", (world,))
    counts = _Counts()
    gen = torch.Generator().manual_seed(9)
    from foak.models.tiny import tiny_config

    vocab = tiny_config("llama").vocab_size
    batches = [torch.randint(0, vocab, (ROWS * world, SEQ), generator=gen) for _ in range(2)]
    results = {}
    for name, (lora, wrapper, options) in CASES.items():
        start = time.perf_counter()
        try:
            plain = _run(lora, wrapper, options, False, batches, rank, world, mesh, counts)
            offloaded = _run(lora, wrapper, options, True, batches, rank, world, mesh, counts)
            results[name] = {"plain": plain, "offloaded": offloaded, "seconds": time.perf_counter() - start}
        except Exception:  # reported by this case's test (the other cases still run)
            results[name] = {"error": traceback.format_exc(), "seconds": time.perf_counter() - start}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    start = time.perf_counter()
    results = run_ranks(_rank_main, WORLD, tmp_path_factory.mktemp("offload_ranks"), timeout_s=180,
                        preload=("torch", "torch.distributed.fsdp", "transformers", "peft", "foak"))
    print(f"\n{WORLD} ranks: {time.perf_counter() - start:.1f} s; per case (rank 0): "
          + ", ".join(f"{n} {r['seconds']:.1f}" for n, r in results[0].items()))
    return results


def _relative(a, b):
    from foak.testing import relative_error

    return relative_error(a.float(), b.float())


@pytest.mark.parametrize("case", list(CASES))
def test_offload_equals_no_offload(runs, case):
    for rank, results in enumerate(runs):
        r = results[case]
        assert "error" not in r, f"rank {rank}: {r['error']}"
        plain, ours = r["plain"], r["offloaded"]
        assert set(ours["grads"]) == set(plain["grads"]) and plain["grads"], rank
        # fp32 master weights and gradients, under the bf16 policy too
        assert ours["param_dtypes"] == ours["grad_dtypes"] == {torch.float32}, ours
        if case in EXACT:
            unequal = [n for n, g in plain["grads"].items() if not torch.equal(ours["grads"][n], g)]
            assert not unequal, (rank, unequal[:5], max(_relative(ours["grads"][n], plain["grads"][n])
                                                         for n in unequal))
            assert all(torch.equal(a, b) for a, b in zip(ours["losses"], plain["losses"], strict=True)), \
                (rank, ours["losses"], plain["losses"])
        loss_err = max(_relative(a, b) for a, b in zip(ours["losses"], plain["losses"], strict=True))
        assert loss_err <= TOL, (rank, loss_err)
        grad_err = {n: _relative(ours["grads"][n], g) for n, g in plain["grads"].items()}
        worst = max(grad_err, key=grad_err.get)
        assert grad_err[worst] <= TOL, (rank, worst, grad_err[worst])
        assert all(g.abs().max() > 0 for g in plain["grads"].values())  # (no vacuous zero gradients)
        assert ours["losses"][1] < ours["losses"][0]  # the steps trained


@pytest.mark.parametrize("case", list(CASES))
def test_layers_were_offloaded(runs, case):
    lora = CASES[case][0]
    for rank, results in enumerate(runs):
        r = results[case]
        assert "error" not in r, f"rank {rank}: {r['error']}"
        ours = r["offloaded"]
        options = CASES[case][2]
        layers = ours["layers"]
        assert layers == options.get("layers", 2)
        offloadable = layers - 1 if lora else layers  # LoRA: layer 0's input is a graph leaf (kept, said)
        offloaded = min(offloadable, options.get("budget_layers", layers))  # the first ones, in layer order
        kept = offloadable - offloaded  # the budget spent: kept on the device
        per_layer = _per_layer(options)  # hidden states [rows, seq, hidden 64]
        dtype = torch.bfloat16 if options.get("bf16") else torch.float32
        for step in ours["steps"]:
            stats = step["stats"]
            assert (stats["layers"], stats["offloaded_layers"], stats["kept_layers"], stats["leaf_layers"]) == \
                (layers, offloaded, kept, 1 if lora else 0), (rank, stats)
            assert stats["offloaded_bytes"] == offloaded * per_layer, (rank, stats)
            # one host copy per offloaded input in the forward, each brought back from the host in the backward
            assert step["copies"] == offloaded and step["unpacked"] == offloaded, (rank, step)
            # the saved input went to the host in the compute dtype and came back in it (same shape, same device)
            assert step["packed_dtypes"] == step["unpacked_dtypes"] == {dtype}, (rank, step)
            assert step["round_trip_changed"] == 0, (rank, step)
        assert ours["steps"][-1]["stats"]["forwards"] == 2
        assert f"{offloaded} of {layers} checkpointed layers' inputs offloaded to CPU memory" in ours["row"], \
            ours["row"]
        assert ("1 kept on the device: a leaf of the autograd graph" in ours["row"]) == lora, ours["row"]
        assert (f"{kept} kept on the device: budget" in ours["row"]) == bool(kept), ours["row"]
        assert ours["budget_in_use"] and all(b == 0 for b in ours["budget_in_use"]), ours["budget_in_use"]
        # the run without the switch went through no offload path
        assert all(s["copies"] == 0 and s["unpacked"] == 0 for s in r["plain"]["steps"]), r["plain"]["steps"]
