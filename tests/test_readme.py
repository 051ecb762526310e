"""The README is what a user reads in five minutes; everything else is in docs/. It stays short,
its links and the docs' links lead somewhere, and the blocks the kind test runs verbatim are there,
each under its marker comment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without its fenced code blocks and inline code: links are in the prose."""
    kept: list[str] = []
    fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def relative_links(text: str) -> list[str]:
    """Every link target that names a file of the repository (anchors dropped)."""
    targets = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s), mailto, ...; an anchor in the same page
        targets.append(target.split("#", 1)[0])
    return targets


def fenced_block_after(text: str, marker: str) -> str:
    """The body of the ```sh block that starts on the line after `marker`."""
    lines = text.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.strip() == marker]
    assert lines[at + 1] == "```sh", f"{marker} is not followed by a ```sh block"
    end = lines.index("```", at + 2)
    return "\n".join(lines[at + 2 : end])


def test_the_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines (at most {MAX_README_LINES}): move the rest to docs/"
    )


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_that_exists(page: Path) -> None:
    missing = [t for t in relative_links(page.read_text()) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to what is not there: {missing}"


def test_the_install_block_is_under_its_marker() -> None:
    block = fenced_block_after(README.read_text(), "<!-- install: run by e2e/tests/test_kind.py -->")
    assert "helm install dra-gpu oci://$REGISTRY/charts/dra-gpu --version $VERSION" in block
    assert "kubectl get resourceslices" in block


def test_the_first_claim_block_is_under_its_marker_and_its_manifest_exists() -> None:
    block = fenced_block_after(README.read_text(), "<!-- first-claim: run by e2e/tests/test_kind.py -->")
    (manifest,) = re.findall(r"kubectl apply -f (\S+)", block)
    assert (ROOT / manifest).is_file(), manifest


def test_links_are_found_outside_code_only() -> None:
    text = "see [a](docs/a.md#x) and [b](https://example.com)\n```\n[c](nowhere.md)\n```\n`[d](no.md)`\n"
    assert relative_links(text) == ["docs/a.md"]


def test_every_cell_of_the_day_2_table_names_a_test_that_exists() -> None:
    """'What survives what' is filled from e2e tests: each one it names is there."""
    section = README.read_text().split("## Day 2: what survives what", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`(test_\w+\.py)(?:::(test_\w+))?`", section)
    assert len(named) >= 7, named
    for module, function in named:
        source = ROOT / "e2e" / "tests" / module
        assert source.is_file(), module
        if function:
            assert re.search(rf"^def {function}\(", source.read_text(), re.M), f"{module}::{function}"
    notes = set(re.findall(r"\[(\d+)\] `test_", section))
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| event")]
    for row in rows:
        for cell in row.strip("|").split("|")[1:]:
            refs = re.findall(r"\[(\d+)\]", cell)
            assert cell.strip() == "-" or refs or "as a crash" in cell, f"a cell without its test: {row}"
            assert set(refs) <= notes, f"{cell.strip()!r} refers to a note the table does not have"
