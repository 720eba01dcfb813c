"""Packaging: ``python -m build`` makes an sdist and, from it, a wheel that holds every file the package
needs; the wheel installed into a fresh venv (outside the checkout, nothing of it importable) runs ``foak
--version`` (from the package metadata) and the README's main job, ``foak train`` on the embedded default;
every dependency and extra names a real package whose bounds admit the versions this environment was tested
with.

The fresh venv gets the wheel alone (``--no-deps``); its dependencies come from this environment's
site-packages through a path entry (torch and transformers are not installed a second time: seconds, not
minutes), which adds no .pth file of it, so an editable install of this checkout there stays invisible."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _requirements(extra: str | None = None) -> list[Requirement]:
    given = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return [Requirement(r) for r in given]


def test_every_dependency_and_extra_is_a_real_package_whose_bounds_admit_the_tested_versions():
    extras = PROJECT["optional-dependencies"]
    assert {"train", "qlora", "bnb", "trl", "test"} <= set(extras)
    checked = []
    for extra in [None, *extras]:
        for req in _requirements(extra):
            if req.name == "foak":  # the test extra: foak[train,trl]
                assert req.extras <= set(extras), req
                continue
            assert req.specifier, f"{req}: no version bound"
            installed = metadata.version(req.name)  # PackageNotFoundError: not installed here
            assert req.specifier.contains(installed, prereleases=True), f"{req} excludes the tested {installed}"
            checked.append(req.name)
    assert {"torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "pytest"} <= set(checked)
    # the extras the README names: train = qlora (foak train, --peft qlora-nf4)
    assert _requirements("train") == _requirements("qlora")


def test_version_comes_from_the_package_metadata():
    import foak

    try:
        expected = metadata.version("foak")
    except metadata.PackageNotFoundError:  # a checkout that is not installed: its pyproject.toml
        expected = PROJECT["version"]
    assert foak.__version__ == expected == PROJECT["version"]
    run = subprocess.run([sys.executable, "-m", "foak.cli", "--version"], capture_output=True, text=True,
                         cwd=REPO / "src", timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"foak {expected}", run


def _source_tree(dest: Path) -> Path:
    """This checkout's files (tracked, and untracked ones git does not ignore) copied to ``dest``: the build
    sees what a clone would, without the checkout's build leftovers."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout (an unpacked sdist): the wheel test builds what git lists")
    listed = listed.stdout.split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def test_the_built_wheel_installs_in_a_fresh_venv_and_runs_the_main_job(tmp_path):
    import importlib.util

    if importlib.util.find_spec("build") is None:  # CI installs it (requirements-test.txt): there it must run
        (pytest.fail if os.environ.get("CI") else pytest.skip)("python -m build is not installed "
                                                               "(requirements-test.txt pins it)")
    source = _source_tree(tmp_path / "source")
    dist = tmp_path / "dist"
    # the sdist, then the wheel built from the unpacked sdist (so the sdist is complete enough to build);
    # --no-isolation: this environment's setuptools (no download)
    build = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    version = PROJECT["version"]
    wheel, sdist = dist / f"foak-{version}-py3-none-any.whl", dist / f"foak-{version}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in dist.iterdir())

    # every file of the package in the checkout is in the wheel (modules and data: scenario YAMLs, ...)
    package = REPO / "src" / "foak"
    expected = {p.relative_to(package.parent).as_posix() for p in package.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    tracked = set(subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "src/foak"],
                                 cwd=REPO, capture_output=True, text=True, check=True).stdout.split())
    expected = {e for e in expected if f"src/{e}" in tracked}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = zf.read(f"foak-{version}.dist-info/METADATA").decode()
        entry_points = zf.read(f"foak-{version}.dist-info/entry_points.txt").decode()
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    assert any(n.startswith("foak/bench/scenarios/") and n.endswith(".yaml") for n in names)
    assert "foak = foak.cli:main" in entry_points
    assert "[axolotl.plugins]\nfoak = foak.integrations.axolotl:FoakPlugin" in entry_points  # (docs/axolotl.md)
    assert "License-Expression: Apache-2.0" in meta and f"Version: {version}" in meta
    for extra in PROJECT["optional-dependencies"]:
        assert f"Provides-Extra: {extra}" in meta, extra

    # a fresh venv holding the wheel alone; this environment's packages through a path entry (no .pth of it runs)
    work = tmp_path / "work"  # outside the checkout: nothing of the source tree is importable
    work.mkdir()
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TRITON_INTERPRET="0", HF_HUB_OFFLINE="1", PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, cwd=work, env=env)
    python = venv / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=300, cwd=work, env=env)
    assert install.returncode == 0 and "Successfully installed foak" in install.stdout, install
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, cwd=work, env=env).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "zz_test_environment.pth").write_text("\n".join(sorted(ours)) + "\n")
    where = subprocess.run([str(python), "-c", "import foak, json, importlib.metadata as m; "
                            "print(json.dumps([foak.__file__, m.version('foak'), foak.__version__]))"],
                           capture_output=True, text=True, cwd=work, env=env, timeout=120)
    assert where.returncode == 0, where.stderr
    file, meta_version, module_version = json.loads(where.stdout)
    assert Path(file).resolve().is_relative_to(venv.resolve()), file  # the wheel's copy, not the checkout's
    assert meta_version == module_version == version
    foak_bin = str(venv / "bin" / "foak")
    got = subprocess.run([foak_bin, "--version"], capture_output=True, text=True, cwd=work, env=env, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == f"foak {version}", got
    # the README's main job: foak train on the embedded default (tiny Llama, generated data; CPU: reference ops)
    job = subprocess.run([foak_bin, "train"], capture_output=True, text=True, cwd=work, env=env, timeout=900)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    summary = json.loads((work / "foak-output" / "train_summary.json").read_text())
    assert summary["steps"] == 60 and summary["final_loss"] < summary["first_loss"] - 1.0, summary
    assert (work / "foak-output" / "loss_curve.png").stat().st_size > 1000
    assert re.search(r"done: 60 steps", job.stdout), job.stdout[-2000:]
    # a bundled data file is read from the installed package
    listing = subprocess.run([foak_bin, "bench", "--list"], capture_output=True, text=True, cwd=work, env=env,
                             timeout=120)
    assert listing.returncode == 0 and "smoke" in listing.stdout, listing
