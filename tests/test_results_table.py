"""The README's performance figures are bench/RESULTS.md's current table against NVIDIA's plugin,
as it is there: no figure quoted from an older run, none edited on the way."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_HEADING = "## Today's figures: against NVIDIA's plugin"
README_HEADING = "### Where dra-gpu stands against NVIDIA's plugin"


def first_table_after(text: str, heading: str) -> list[str]:
    """The rows of the first Markdown table after the line that starts with `heading`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows: list[str] = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            rows.append(line)
        elif rows or line.startswith("#"):
            break
    return rows


def test_the_readme_quotes_the_current_table_against_nvidia_and_nothing_older() -> None:
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    readme = (ROOT / "README.md").read_text()
    table = first_table_after(results, RESULTS_HEADING)
    assert len(table) > 5, "bench/RESULTS.md has no table of figures against NVIDIA's plugin"
    # it is the first table of the file: the current one
    assert next(line for line in results.splitlines() if line.startswith("|")) == table[0]
    assert first_table_after(readme, README_HEADING) == table
    # and the only figures the README's performance section holds
    section = readme[readme.index(README_HEADING) :]
    section = section[: section.find("\n## ")] if "\n## " in section else section
    assert sum(line.startswith("|") for line in section.splitlines()) == len(table)


def test_a_table_ends_at_its_first_non_table_line() -> None:
    text = "# A\ntext\n| a |\n|---|\n| 1 |\nafter\n| other |\n"
    assert first_table_after(text, "# A") == ["| a |", "|---|", "| 1 |"]
