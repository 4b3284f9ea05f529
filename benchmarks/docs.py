"""Writes the latest results into ``docs/benchmarks.md`` between two markers, leaving the
rest of the page (the method) as it is. The suite writes the ``results`` block, the
growth table (:mod:`benchmarks.scale`) the ``scale`` block."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DOCS_PATH", "write_results"]

DOCS_PATH = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
_WRITERS = {"results": "python -m benchmarks --write-docs", "scale": "python -m benchmarks.scale --write-docs"}


def write_results(markdown: str, path: Path = DOCS_PATH, block: str = "results") -> None:
    """Replaces the text between ``block``'s markers (appends both when the page lacks them).

    Args:
        markdown: The new text of the block.
        path: The page.
        block: ``"results"`` (the suite's tables) or ``"scale"`` (the growth table).
    """
    start, end = f"<!-- {block}:start (written by `{_WRITERS[block]}`) -->", f"<!-- {block}:end -->"
    page = path.read_text() if path.exists() else "# Benchmarks\n"
    text = f"{start}\n\n{markdown.strip()}\n\n{end}"
    if start in page and end in page:
        before, rest = page.split(start, 1)
        page = before + text + rest.split(end, 1)[1]
    else:
        page = page.rstrip() + "\n\n" + text + "\n"
    path.write_text(page)
