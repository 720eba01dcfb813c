"""Run bitsandbytes' CPU library as on a CPU without AVX-512, on one that has it (a tool, not part of CI).

bitsandbytes 0.50.2's libbitsandbytes_cpu.so chooses its AVX-512 paths with function-local statics (the answers
of has_avx512f / has_avx512bf16, each behind a C++ guard variable, two LTO copies of each) filled from libgcc's
cpuid data on first use; no environment variable reaches them. With BNB_FORCE_NO_AVX512=1 this file, imported
by Python at start-up when its folder is on PYTHONPATH, loads the library before bitsandbytes does (ctypes then
hands bitsandbytes the same handle), finds the statics in its symbol table (``nm``), marks them initialized and
false. ATEN_CPU_CAPABILITY=avx2 puts torch on its AVX2 kernels (bitsandbytes' own _has_avx512 reads that). The
forked/forkserver ranks of tests/test_fsdp.py inherit both. From the repository root:

    BNB_FORCE_NO_AVX512=1 ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=tests/tools/bnb_without_avx512:src \\
        python -m pytest tests/test_nf4.py tests/test_lora_nf4_rules.py tests/test_fsdp.py -k "nf4 or not fsdp"
"""

import ctypes
import importlib.util
import os
import subprocess

if os.environ.get("BNB_FORCE_NO_AVX512") == "1":
    spec = importlib.util.find_spec("bitsandbytes")
    path = os.path.join(list(spec.submodule_search_locations)[0], "libbitsandbytes_cpu.so")
    lib = ctypes.CDLL(path)
    symbols = {}
    for line in subprocess.run(["nm", path], capture_output=True, text=True, check=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 3:
            symbols[parts[2]] = int(parts[0], 16)
    base = ctypes.cast(lib.has_avx512f_cpu, ctypes.c_void_p).value - symbols["has_avx512f_cpu"]
    statics = [name for name in symbols if "supported_avx512" in name]
    assert len(statics) == 8, f"{path}: expected 8 has_avx512* statics (bitsandbytes 0.50.2), found {statics}"
    for name in statics:
        # a guard variable (_ZGV...) says "initialized"; the static itself holds the answer: no
        ctypes.c_uint8.from_address(base + symbols[name]).value = 1 if name.startswith("_ZGV") else 0
    lib.has_avx512f_cpu.restype = lib.has_avx512bf16_cpu.restype = ctypes.c_bool
    assert not lib.has_avx512f_cpu() and not lib.has_avx512bf16_cpu()
