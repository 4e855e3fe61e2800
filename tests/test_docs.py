"""The documentation builds and what it shows runs: the MkDocs site builds with ``--strict`` (a broken link, a missing
anchor or a page outside the nav fails it), every ```` ```python ```` block of README.md and of the docs pages runs,
and the ``seqnorm`` subcommands the shell blocks use exist.

A page's Python blocks run in order as one script, in a fresh namespace, from a temporary directory; a block that is
not meant to run is marked by a line ``<!-- skip -->`` right above its fence (none is, so far). docs/api.md is the
exception: its blocks are signatures (``scripts/api_reference.py`` writes them), checked to parse as a ``def``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SKIP = "<!-- skip -->"
FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)(.*)$")
SIGNATURES = DOCS / "api.md"


def fenced_blocks(text: str) -> list[tuple[str, int, str, bool]]:
    """Each fenced block of a Markdown text: (language, line of its first code line, code, marked skip)."""
    blocks, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        opening = FENCE.match(lines[index].strip())
        if opening is None:
            index += 1
            continue
        fence, language = opening.group(1), opening.group(2).lower()
        end = index + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        skipped = index > 0 and lines[index - 1].strip() == SKIP
        indent = len(lines[index]) - len(lines[index].lstrip())
        code = "\n".join(line[indent:] for line in lines[index + 1 : end])
        blocks.append((language, index + 2, code, skipped))
        index = end + 1
    return blocks


def python_script(path: Path) -> str:
    """The page's runnable Python blocks as one script, each block at its own line numbers (tracebacks name the
    page's lines)."""
    lines = [""] * len(path.read_text().splitlines())
    for language, first, code, skipped in fenced_blocks(path.read_text()):
        if language in ("python", "py") and not skipped:
            for offset, line in enumerate(code.splitlines()):
                lines[first - 1 + offset] = line
    return "\n".join(lines) + "\n"


def pages() -> list[Path]:
    """README.md and every page of the site (the experiments' generated results pages have no Python)."""
    return [ROOT / "README.md", *sorted(path for path in DOCS.rglob("*.md") if path != SIGNATURES)]


PAGES_WITH_PYTHON = [path for path in pages() if python_script(path).strip()]


def test_the_fences_are_read_as_written() -> None:
    text = "intro\n\n```python\nx = 1\n```\n\n<!-- skip -->\n```python\nraise SystemExit\n```\n\n```bash\nls\n```\n"
    assert fenced_blocks(text) == [("python", 4, "x = 1", False), ("python", 9, "raise SystemExit", True),
                                   ("bash", 13, "ls", False)]  # fmt: skip
    # the README's own blocks are found, and the pages a user reads first have Python that runs
    assert sum(language == "python" for language, *_ in fenced_blocks((ROOT / "README.md").read_text())) >= 4
    assert {"README.md", "cells-and-layers.md", "norms.md"} <= {path.name for path in PAGES_WITH_PYTHON}


@pytest.mark.parametrize("page", PAGES_WITH_PYTHON, ids=lambda path: str(path.relative_to(ROOT)))
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # whatever a snippet writes lands here
    torch.manual_seed(0)
    code = compile(python_script(page), str(page), "exec")
    exec(code, {"__name__": "__main__", "__file__": str(page)})


def test_api_signatures_parse() -> None:
    blocks = [code for language, _, code, _ in fenced_blocks(SIGNATURES.read_text()) if language == "python"]
    assert len(blocks) > 20
    for code in blocks:
        ast.parse("def " + code.strip().replace("(...)", "(*args, **kwargs)") + ": ...")


@pytest.mark.slow
def test_shell_blocks_use_real_subcommands() -> None:
    """Every `seqnorm <subcommand>` in a shell block is one that `seqnorm --help` lists (the help runs; the
    commands themselves train models and read files, so they are run by the CLI tests, not here)."""
    used = set()
    for page in pages():
        for language, _, code, _ in fenced_blocks(page.read_text()):
            if language in ("bash", "sh", "shell", "console"):
                used |= set(re.findall(r"(?:^|\s)seqnorm ([a-z]+)\b", code))
    assert {"fit", "generate", "test", "predict", "configs"} <= used
    result = subprocess.run(
        [sys.executable, "-m", "seqnorm", "--help"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    listed = set(re.findall(r"^\s+([a-z]+)\s", result.stdout, re.MULTILINE))
    assert used <= listed, f"not in `seqnorm --help`: {used - listed}\n{result.stdout}"


def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_site_builds_strictly(tmp_path: Path) -> None:
    result = _mkdocs(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-5000:]
    # every page of the nav was written, and the current-numbers page shows BENCHMARKS.md's tables
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    for page in nav:
        built = tmp_path / "site" / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert built.is_file(), page
    benchmarks = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    assert "runs FF1–FF4" in benchmarks and "--8&lt;--" not in benchmarks


@pytest.mark.slow
def test_strict_build_fails_on_a_broken_link(tmp_path: Path) -> None:
    """The site's own validation settings, on a one-page site: a link to a missing page, to a file outside docs/
    (the site has none: README.md's `BENCHMARKS.md` is shown by docs/benchmarks.md instead) and to a missing anchor
    each fail the strict build; the same page with its links fixed builds."""
    settings = (ROOT / "mkdocs.yml").read_text()
    settings = settings[: settings.index("\nnav:")] + "\nnav:\n  - index.md\n  - other.md\n"
    (tmp_path / "mkdocs.yml").write_text(settings)
    (tmp_path / "BENCHMARKS.md").write_text("numbers\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Here\n")
    broken = ["missing.md", "../BENCHMARKS.md", "other.md#nowhere"]
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n" + " ".join(f"[x]({link})" for link in broken) + "\n")
    result = _mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    for link in broken:
        assert f"'{link}'" in result.stderr, result.stderr
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[x](other.md) [y](other.md#here)\n")
    result = _mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-3000:]
