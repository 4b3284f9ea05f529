"""Writes the latest results into ``docs/benchmarks.md`` between two markers, leaving the
rest of the page (the method) as it is."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DOCS_PATH", "write_results"]

DOCS_PATH = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
_START = "<!-- results:start (written by `python -m benchmarks --write-docs`) -->"
_END = "<!-- results:end -->"


def write_results(markdown: str, path: Path = DOCS_PATH) -> None:
    """Replaces the text between the markers (appends both when the page lacks them)."""
    page = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{_START}\n\n{markdown.strip()}\n\n{_END}"
    if _START in page and _END in page:
        before, rest = page.split(_START, 1)
        page = before + block + rest.split(_END, 1)[1]
    else:
        page = page.rstrip() + "\n\n" + block + "\n"
    path.write_text(page)
