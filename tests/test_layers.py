"""foak's layers (docs/architecture.md): imports only point downwards, including the imports inside functions;
ops/ imports no transformers, peft or trl. Read from the source (ast), nothing imported."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# top to bottom; a package may import its own layer's packages and any below, never one above
LAYERS = [
    {"cli"},
    {"train", "train_cli", "verify", "bench", "testing"},
    {"api", "integrations"},  # foak.api registers integrations.trl / trl_distill; the plugins call foak.patch
    {"config"},
    {"models"},
    {"patching"},
    {"quant"},
    {"ops"},
    {"alloc_conf", "backend", "data", "model_source"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + ([f"foak.{a.name}" for a in node.names] if node.module == "foak" else [])
            yield from ((name, node.lineno) for name in names)
        elif isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)


def _package(path: Path) -> str:
    parts = path.relative_to(SRC / "foak").with_suffix("").parts
    return parts[0]


def test_every_package_has_a_layer():
    packages = {_package(p) for p in (SRC / "foak").rglob("*.py")} - {"__init__", "__main__"}
    assert packages <= RANK.keys(), f"give {sorted(packages - RANK.keys())} a layer in LAYERS"


def test_imports_point_downwards():
    upward = []
    for path in sorted((SRC / "foak").rglob("*.py")):
        source = _package(path)
        if source not in RANK:
            continue
        for name, line in _imports(path):
            parts = name.split(".")
            if parts[0] != "foak" or len(parts) < 2 or parts[1] not in RANK:
                continue
            if RANK[parts[1]] < RANK[source]:
                upward.append(f"{path.relative_to(SRC)}:{line} imports {name}")
    assert not upward, "imports pointing upwards:\n" + "\n".join(upward)


def test_ops_know_nothing_of_transformers_peft_trl():
    found = [f"{path.relative_to(SRC)}:{line} imports {name}"
             for path in sorted((SRC / "foak" / "ops").rglob("*.py"))
             for name, line in _imports(path) if name.split(".")[0] in ("transformers", "peft", "trl")]
    assert not found, "\n".join(found)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    # the checker itself: a patching module importing foak.models is reported
    fake = tmp_path / "foak" / "patching"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("def f():\n    from foak.models import rules_for\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    try:
        test_imports_point_downwards()
    except AssertionError as error:
        assert "foak/patching/bad.py:2 imports foak.models" in str(error)
    else:
        raise AssertionError("an upward import went unseen")
