"""The README and docs/ as a user reads them: every block marked runnable runs (```python runnable: executed on
the CPU with foak's reference ops, in a fresh namespace and a temporary directory; ```yaml runnable: a valid
foak config), every relative link points to a file that exists (and a #anchor to a heading of it), every repo
file they name exists, and the README keeps the two commands CI runs (.ci/run reads them from it) within its
250 lines. The convention is documented in docs/architecture.md (section Documentation)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = "runnable"


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number of the opening fence, info string, body) of every fenced code block. A fence of N backticks
    closes only with N or more backticks, so a block may show a fence inside itself."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^\s*(`{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        fence, info, start, body = m.group(1), m.group(2).strip(), i + 1, []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{fence}`*\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        blocks.append((start, info, "\n".join(body) + "\n"))
        i += 1
    return blocks


def prose(text: str) -> str:
    """The page without its fenced blocks and inline code (links inside code are not links)."""
    lines = text.splitlines()
    for start, _, body in reversed(fenced_blocks(text)):
        del lines[start - 1:start + body.count("\n") + 1]
    return re.sub(r"`[^`\n]*`", "", "\n".join(lines))


def runnable_blocks(language: str) -> list:
    return [pytest.param(page, line, body, id=f"{page.relative_to(REPO)}:{line}")
            for page in PAGES for line, info, body in fenced_blocks(page.read_text())
            if info.split() == [language, RUNNABLE]]


def test_the_pages_have_runnable_blocks():
    # the marker cannot silently disappear: the README's quick starts and the config / ops examples carry it
    assert len(runnable_blocks("python")) >= 3 and len(runnable_blocks("yaml")) >= 2
    readme = (REPO / "README.md").read_text()
    assert sum(info.split() == ["python", RUNNABLE] for _, info, _ in fenced_blocks(readme)) >= 2
    # an info string that mentions runnable in any other form would be skipped without notice
    for page in PAGES:
        for line, info, _ in fenced_blocks(page.read_text()):
            if RUNNABLE in info:
                assert info.split() in (["python", RUNNABLE], ["yaml", RUNNABLE]), f"{page.name}:{line}: {info!r}"


@pytest.mark.parametrize(("page", "line", "body"), runnable_blocks("python"))
def test_python_block_runs(page, line, body, tmp_path, monkeypatch, reference_ops):
    monkeypatch.chdir(tmp_path)
    started = time.perf_counter()
    exec(compile(body, f"{page.relative_to(REPO)} (block at line {line})", "exec"), {"__name__": "__docs__"})
    assert time.perf_counter() - started < 30, "runnable blocks must stay quick (tiny models, reference ops)"


@pytest.mark.parametrize(("page", "line", "body"), runnable_blocks("yaml"))
def test_yaml_block_is_a_valid_config(page, line, body):
    from foak.config import load_config

    config = load_config(yaml.safe_load(body))
    assert config.enabled_rules(), f"{page.name}:{line}: a config block that switches nothing on"


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()  # (GitHub keeps "_")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text()
    code_lines = {n for start, _, body in fenced_blocks(text) for n in range(start, start + body.count("\n") + 2)}
    return {_slug(m.group(1)) for n, line in enumerate(text.splitlines(), 1) if n not in code_lines
            for m in [re.match(r"^#{1,6}\s+(.*)$", line)] if m}


def test_slug_matches_github():
    assert _slug("Measurements (H200)") == "measurements-h200"
    assert _slug("`foak train`") == "foak-train"
    assert _slug("torch.compile") == "torchcompile"
    assert _slug("`offload_activations`") == "offload_activations"
    assert _slug("Several GPUs: DDP and FSDP2") == "several-gpus-ddp-and-fsdp2"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_to_existing_files(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no file {linked.relative_to(REPO) if linked.is_relative_to(REPO) else linked})")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no heading #{anchor} in {linked.name})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


# names a user's run reads or writes, not files of this repository
USER_FILES = {"config.json", "foak.yaml", "loss_curve.png", "data.jsonl", "pairs.jsonl", "train_summary.json",
              "trainer_state.json", "foak_gptq_base.json"}


def _expand_braces(token: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", token)
    if not match:
        return [token]
    return [x for option in match.group(1).split(",")
            for x in _expand_braces(token[:match.start()] + option + token[match.end():])]


def test_every_file_the_pages_name_exists():
    """A file name in the README or a docs page (code and prose; brace and <placeholder> / * patterns expanded)
    is a file of the repository, at any depth when the name carries no directory."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    files += [str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")] + [p.name for p in REPO.iterdir()]
    missing = []
    for page in PAGES:
        tokens = set(re.findall(r"[\w./<>*{},-]+\.(?:md|py|json|jsonl|png|log|yaml|txt|toml)\b", page.read_text()))
        for token in tokens - USER_FILES:
            for name in _expand_braces(token):
                if name.startswith("docs/") or page.parent.name != "docs":
                    candidates = [name]
                else:  # a docs page names its siblings as they are linked
                    candidates = [name, f"docs/{name}"]
                pattern = [re.sub(r"<[^>]*>", ".*", re.escape(c).replace(r"\*", ".*").replace(r"\<", "<")
                                  .replace(r"\>", ">")) for c in candidates]
                if not any(re.fullmatch(f"(.*/)?{p}", f) for p in pattern for f in files):
                    missing.append(f"{page.relative_to(REPO)}: {name}")
    assert not missing, f"files named in the docs that are not in the repo: {sorted(missing)}"


def _readme_command(marker: str) -> str:
    """What .ci/run executes: the first non-comment line after the line that starts with the marker."""
    found = False
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith(marker):
            found = True
        elif found and not line.startswith("#"):
            return line
    raise AssertionError(f"the README has no command under {marker!r}")


def test_readme_keeps_the_ci_commands_and_its_length():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    ci = (REPO / ".ci" / "run").read_text()
    for marker in ("# 1. install, then run the main job", "# 2. run the tests"):
        assert marker[2:] in ci  # the markers .ci/run looks for
    install = _readme_command("# 1. install, then run the main job")
    assert "pip install" in install and "foak verify" in install and "foak train" in install
    assert re.search(r"-m pytest\b", _readme_command("# 2. run the tests"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_issue_tags(page):
    tags = re.findall(r"\[[a-z-]+\] issue|\bissue \d+|(?<![\w&])#\d+\b", page.read_text())
    assert not tags, f"{page.relative_to(REPO)}: user docs name no issues: {tags}"
