"""Tables of figures summarised over interleaved rounds, and the helpers that pick them.

Every figure is computed per round, then summarised by its median over the rounds (the
range follows in brackets when there are several). Ratios are paired: computed within
each round from the two contenders measured side by side, then summarised the same way.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Callable

__all__ = ["Round", "Pick", "Table", "Summary", "COMPARISON_HEADER", "seconds", "rate", "times", "mb", "mb_s", "us",
           "pct", "met", "get", "ratio", "largest", "mean"]

Round = dict[str, dict]
Pick = Callable[[Round], float]

#: The columns of :meth:`Summary.compare` rows.
COMPARISON_HEADER = ["Figure", "TorchEstimator", "Reference", "Reference value", "Ratio", "Target", "Met"]


@dataclass
class Table:
    """A titled table of display strings."""

    title: str
    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        """The table as aligned Markdown, readable in a terminal too."""
        widths = [max(len(row[i]) for row in [self.header, *self.rows]) for i in range(len(self.header))]
        lines = [_line(self.header, widths), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        lines += [_line(row, widths) for row in self.rows]
        return f"### {self.title}\n\n" + "\n".join(lines)


def _line(cells: list[str], widths: list[int]) -> str:
    return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + " |"


class Summary:
    """The per-round values of the figures, with display helpers.

    Args:
        rounds: One ``{contender key: result}`` per round.
    """

    def __init__(self, rounds: list[Round]) -> None:
        self.rounds = rounds

    def values(self, pick: Pick) -> list[float]:
        """The figure in every round that has it."""
        found = []
        for results in self.rounds:
            try:
                value = pick(results)
            except (KeyError, TypeError, ZeroDivisionError):
                continue
            if value is not None:
                found.append(value)
        return found

    def median(self, pick: Pick) -> float | None:
        """The figure's median over the rounds, or None where no round has it."""
        values = self.values(pick)
        return statistics.median(values) if values else None

    def show(self, pick: Pick, unit: Callable[[float], str]) -> str:
        """The median with its unit, then ``[min–max]`` without it when there are several."""
        values = self.values(pick)
        if not values:
            return "n/a"
        text = unit(statistics.median(values))
        if len(values) > 1:
            text += f" [{_number(unit(min(values)))}–{_number(unit(max(values)))}]"
        return text

    def compare(self, figure: str, ours: Pick, reference: str, ref: Pick, unit: Callable[[float], str],
                target: str = "") -> list[str]:
        """A row of :data:`COMPARISON_HEADER`: our figure, the reference's, their paired
        ratio, and whether its median meets ``target`` (``"<=0.5x"``, ``">=0.95x"``)."""
        paired = ratio(ours, ref)
        return [figure, self.show(ours, unit), reference, self.show(ref, unit), self.show(paired, times),
                target or "-", met(self.median(paired), target) if target else "-"]


def _number(text: str) -> str:
    return re.match(r"[\d,.\-]*", text).group(0) or text


def seconds(value: float) -> str:
    """``1.23 s``."""
    return f"{value:.2f} s"


def rate(value: float) -> str:
    """``12,345/s``."""
    return f"{value:,.0f}/s"


def times(value: float) -> str:
    """``0.95x``."""
    return f"{value:.2f}x"


def mb(value: float) -> str:
    """``1,024 MB``."""
    return f"{value:,.0f} MB"


def mb_s(value: float) -> str:
    """``100 MB/s``."""
    return f"{value:,.0f} MB/s"


def us(value: float) -> str:
    """``6.4 us``, or ``296 us`` from 100 up."""
    return f"{value:.1f} us" if value < 100 else f"{value:.0f} us"


def pct(value: float) -> str:
    """``7.0%``."""
    return f"{value:.1f}%"


def met(value: float | None, target: str) -> str:
    """``yes`` or ``NO``: does ``value`` meet ``target`` (``"<=0.5x"``, ``">=0.95x"``)."""
    if value is None:
        return "n/a"
    bound = float(target[2:].rstrip("x"))
    return "yes" if (value <= bound if target.startswith("<=") else value >= bound) else "NO"


def get(key: str, *path: str | int) -> Pick:
    """Picks ``results[key][path[0]][path[1]]...`` of a round."""
    def pick(results: Round) -> float:
        value = results[key]
        for part in path:
            value = value[part]
        return value
    return pick


def ratio(a: Pick, b: Pick) -> Pick:
    """``a / b`` within a round."""
    return lambda results: a(results) / b(results)


def largest(pick: Callable[[Round], list[float]]) -> Pick:
    """The largest of a per-rank list (the largest rank's figure)."""
    return lambda results: max(pick(results))


def mean(*picks: Pick) -> Pick:
    """The mean of several figures of the same round."""
    return lambda results: sum(pick(results) for pick in picks) / len(picks)
