"""The packages a benchmark needs on the GPU machine that its image lacks, as Python 3.12 wheels to carry.

    python3 benchmarks/wheels.py base trl datasets   # download into .wheels/ (ignored by git; carry ".wheels")
    python3 benchmarks/wheels.py unsloth --dir .wheels_unsloth
    python3 benchmarks/wheels.py --list              # the sets, their pins and what needs them

The GPU image (Python 3.12, torch 2.11, transformers 5.17, peft, accelerate, datasets' own dependencies) has no
pydantic, bitsandbytes, Liger, TRL, datasets or Unsloth. A set is downloaded without dependencies (every wheel it
needs is named here, pinned), for CPython 3.12 on x86_64 Linux. Unsloth's wheel (28.6 MB) is rewritten without its studio/
and unsloth_cli/ folders (1.9 MB left; the training path never imports them). The script prints the total size
(the device tool carries 64 MiB per call) and the install line to run first on the GPU machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

SETS = {
    # foak's config schema, QLoRA's NF4 base, Liger (the peer in every table)
    "base": ("pydantic==2.13.4", "pydantic_core==2.46.4", "annotated-types==0.8.0", "typing-inspection==0.4.5",
             "bitsandbytes==0.50.2", "liger-kernel==0.8.5"),
    # benchmarks/rl.py, trl_fused_head.py, distill.py, real_world.py (TRL's trainers)
    "trl": ("trl==1.16.0",),
    # TRL's trainers take a datasets.Dataset (rl.py, distill.py): the image has datasets' dependencies, not datasets
    "datasets": ("datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19"),
    # benchmarks/long_context.py's unsloth frameworks (with base and trl)
    "unsloth": ("unsloth==2026.10.9", "unsloth_zoo==2026.10.9", "datasets==5.2.0", "dill==0.4.1",
                "multiprocess==0.70.19"),
}
USED_BY = {"base": "every benchmark with Liger, QLoRA or a foak YAML", "trl": "rl.py, trl_fused_head.py, distill.py",
           "datasets": "rl.py, distill.py (with trl)",
           "unsloth": "long_context.py --frameworks unsloth unsloth-tiled (install base and trl too)"}
STRIP = {"unsloth": ("studio/", "unsloth_cli/")}  # wheel name prefix -> folders left out
CARRY_LIMIT = 64 << 20


def download(specs: tuple[str, ...], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
           "manylinux2014_x86_64", "--platform", "manylinux_2_24_x86_64", "--platform", "any", "-d", str(dest), *specs]
    subprocess.run(cmd, check=True)


def strip_wheel(path: Path, prefixes: tuple[str, ...]) -> None:
    """Rewrites the wheel without the files under ``prefixes`` (and their RECORD lines)."""
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        names = [n for n in src.namelist() if not n.startswith(prefixes)]
        for name in names:
            data = src.read(name)
            if name.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if not line.startswith(prefixes)) + "\n").encode()
            dst.writestr(src.getinfo(name), data)
    tmp.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sets", nargs="*", metavar="SET", help=f"one or more of {', '.join(SETS)}")
    parser.add_argument("--dir", type=Path, default=Path(".wheels"))
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    unknown = [s for s in args.sets if s not in SETS]
    if unknown:
        parser.error(f"unknown set(s) {unknown}: choose from {list(SETS)}")
    if args.list or not args.sets:
        for name, specs in SETS.items():
            print(f"{name:8} {USED_BY[name]}\n         " + " ".join(specs))
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    for name in args.sets:
        download(SETS[name], args.dir)
        for wheel in args.dir.glob("*.whl"):
            for prefix, folders in STRIP.items():
                if wheel.name.startswith(prefix + "-"):
                    strip_wheel(wheel, folders)
    wheels = sorted(args.dir.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"{args.dir}: {len(wheels)} wheels, {total / 2**20:.1f} MiB" +
          ("" if total <= CARRY_LIMIT else f"  (over the {CARRY_LIMIT >> 20} MiB a call carries: split the sets)"))
    print("on the GPU machine: python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site "
          f"{args.dir}/*.whl && export PYTHONPATH=/tmp/site:$PWD/src")
    return 0


if __name__ == "__main__":
    sys.exit(main())
