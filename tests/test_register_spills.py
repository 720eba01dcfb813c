"""The row kernels of the loss ops, compiled for sm_90 (the H200) with the installed Triton, at the launch
configurations the ops choose for a 128256-word vocabulary: none spills registers to local memory (more than
8 bytes per thread). At 32 warps and 16384-column blocks, the per-lane state of a forward with several row
statistics did not fit in the 64 registers a thread gets (DPO's log-probs request spilled 240 bytes per thread with
Triton 3.6, the GPU image's). Compiling needs no GPU (Triton's NVIDIA backend ships ptxas and cuobjdump), but not
the interpreter: one subprocess without TRITON_INTERPRET compiles every case."""

import json
import os
import re
import subprocess
import sys

import pytest

VOCAB = 128256
MAX_STACK_BYTES = 8
# TRL's requests (entropy, log_sum_sq_probs, mean_logits, is_top1): all five outputs, DPO, KTO, GRPO, reference
REQUESTS = {"all": (1, 1, 1, 1), "dpo": (1, 0, 1, 1), "kto": (1, 0, 1, 0), "grpo": (1, 0, 0, 0), "ref": (0, 0, 0, 0)}
CASES = (
    [f"llp_forward {name} softcap={cap}" for name in REQUESTS for cap in (0, 1)]
    + ["llp_backward d_logp", "llp_backward d_ent", "llp_backward d_logp d_ent softcap"]
    # (row statistics, softcap, label smoothing with class weights and z-loss) of a forward that also writes the
    # gradient (the fused loss's path), and the backward alone
    + [f"ce rows={r} softcap={c} smoothing={s} forward={f}"
       for r, c, s, f in ((0, 0, 0, 1), (1, 0, 0, 1), (1, 1, 1, 1), (0, 1, 1, 1), (0, 1, 1, 0))]
)


def _signature(names: str, types: str) -> dict:
    return dict(zip(names.split(), types.split()))


def _compile_case(case: str) -> dict:
    """(kernel, signature, constexprs, num_warps) of one case, at the launch configuration the op chooses."""
    import foak.ops.cross_entropy as ce
    import foak.ops.linear_log_probs as llp

    words = case.split()
    options = {k: int(v) for k, v in (w.split("=") for w in words if "=" in w)}
    if words[0] == "llp_forward":
        flags = [bool(f) for f in REQUESTS[words[1]]]
        softcap = 30.0 if options["softcap"] else None
        config = llp._launch_config(VOCAB, llp._forward_pressure(*flags, softcap))
        signature = _signature(
            "LOGITS logits_stride TARGET LOGP STATS ENT SQ MEAN TOP1 n_rows n_cols logit_scale softcap inv_temperature",
            "*bf16 i32 *i64 *fp32 *fp32 *fp32 *fp32 *fp32 *fp32 i32 i32 fp32 fp32 fp32")
        constexprs = dict(HAS_SOFTCAP=softcap is not None, HAS_ENTROPY=flags[0], HAS_SQ=flags[1], HAS_MEAN=flags[2],
                          HAS_TOP1=flags[3], BLOCK=config["BLOCK"])
        return dict(kernel=llp._forward_kernel, signature=signature, constexprs=constexprs, warps=config["num_warps"])
    if words[0] == "llp_backward":
        config = llp._launch_config(VOCAB)
        signature = _signature(
            "LOGITS logits_stride OUT out_stride TARGET STATS ENT D_LOGP D_ENT n_rows n_cols logit_scale softcap "
            "inv_temperature", "*bf16 i32 *bf16 i32 *i64 *fp32 *fp32 *fp32 *fp32 i32 i32 fp32 fp32 fp32")
        constexprs = dict(HAS_SOFTCAP="softcap" in words, HAS_D_LOGP="d_logp" in words, HAS_D_ENT="d_ent" in words,
                          BLOCK=config["BLOCK"])
        return dict(kernel=llp._backward_kernel, signature=signature, constexprs=constexprs, warps=config["num_warps"])
    rows, softcap, smoothing, forward = (bool(options[k]) for k in ("rows", "softcap", "smoothing", "forward"))
    config = ce._row_config(VOCAB, ce._forward_pressure(rows, 30.0 if softcap else None, 0.1 * smoothing)
                            if forward else 0)
    signature = _signature(
        "LOGITS logits_stride TARGET GRAD grad_stride LOSS STATS ZLOSS ACC ENT DLOSS dloss_stride CLASS_W CLASS_W_SUM "
        "n_rows n_cols ignore_index label_smoothing lse_square_scale inv_scaling softcap",
        "*bf16 i32 *i64 *bf16 i32 *fp32 *fp32 *fp32 *fp32 *fp32 *fp32 i32 *fp32 *fp32 i32 i32 i32 fp32 fp32 fp32 fp32")
    constexprs = dict(HAS_SOFTCAP=softcap, HAS_SMOOTHING=smoothing, HAS_ZLOSS=smoothing, HAS_WEIGHT=smoothing,
                      ROW_STATS=rows, FORWARD=forward, WRITE_GRAD=True, BLOCK=config["BLOCK"])
    return dict(kernel=ce._cross_entropy_kernel, signature=signature, constexprs=constexprs,
                warps=config["num_warps"])


def _stack_bytes(case: str, tmp: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = _compile_case(case)
    signature = {**spec["signature"], **{name: "constexpr" for name in spec["constexprs"]}}
    compiled = triton.compile(ASTSource(fn=spec["kernel"], signature=signature, constexprs=spec["constexprs"]),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": spec["warps"]})
    cubin = os.path.join(tmp, "kernel.cubin")
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if not match:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {usage}")
    return {"registers": int(match.group(1)), "stack": int(match.group(2)), "block": spec["constexprs"]["BLOCK"],
            "warps": spec["warps"]}


@pytest.fixture(scope="module")
def usage(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said explicitly (3.9 warns otherwise)
    done = subprocess.run([sys.executable, __file__, str(tmp_path_factory.mktemp("cubin"))], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_no_register_spills_on_sm90(usage, case):
    assert usage[case]["stack"] <= MAX_STACK_BYTES, (case, usage[case])


if __name__ == "__main__":
    # python tests/test_register_spills.py DIR [--old-blocks]: the usage of each case as JSON (--old-blocks: every
    # forward at 16384 columns, the launch configuration before the spill fix)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    if "--old-blocks" in sys.argv:
        import foak.ops.cross_entropy as ce
        import foak.ops.linear_log_probs as llp

        llp.TUNING["forward_blocks"], ce.TUNING["block_stats"] = (16384,) * 4, 16384
    print(json.dumps({case: _stack_bytes(case, sys.argv[1]) for case in CASES}))
