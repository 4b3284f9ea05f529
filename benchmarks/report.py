"""Turns the rounds' raw results into the tables the suite prints (and writes to docs).

Every figure is computed per round, then summarised by its median over the rounds (the
range follows in brackets when there are several). Ratios are paired: computed within
each round from the two contenders measured side by side, then summarised the same way.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Callable

from benchmarks.suite import Contender
from benchmarks.workload import Workload

__all__ = ["Table", "build_tables", "load_summary"]

Round = dict[str, dict]
Pick = Callable[[Round], float]


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


class _Summary:
    """The per-round values of the figures, with display helpers."""

    def __init__(self, rounds: list[Round]) -> None:
        self.rounds = rounds

    def values(self, pick: Pick) -> list[float]:
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


def _number(text: str) -> str:
    return re.match(r"[\d,.\-]*", text).group(0) or text


def _s(value: float) -> str:
    return f"{value:.2f} s"


def _rate(value: float) -> str:
    return f"{value:,.0f}/s"


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _mb(value: float) -> str:
    return f"{value:,.0f} MB"


def _mb_s(value: float) -> str:
    return f"{value:,.0f} MB/s"


def _us(value: float) -> str:
    return f"{value:.1f} us" if value < 100 else f"{value:.0f} us"


def _pct(value: float) -> str:
    return f"{value:.1f}%"


def _met(ratio: float | None, target: str) -> str:
    if ratio is None:
        return "n/a"
    bound = float(target[2:].rstrip("x"))
    return "yes" if (ratio <= bound if target.startswith("<=") else ratio >= bound) else "NO"


def _get(key: str, *path: str) -> Pick:
    def pick(results: Round) -> float:
        value = results[key]
        for part in path:
            value = value[part]
        return value
    return pick


def _ratio(a: Pick, b: Pick) -> Pick:
    return lambda results: a(results) / b(results)


def _largest(pick: Callable[[Round], list[float]]) -> Pick:
    return lambda results: max(pick(results))


def _headline(summary: _Summary, labels: dict[str, str]) -> Table:
    rows: list[list[str]] = []

    def add(figure: str, ours: Pick, reference: str, ref: Pick, unit: Callable[[float], str], target: str = "") -> None:
        ratio = _ratio(ours, ref)
        rows.append([figure, summary.show(ours, unit), reference, summary.show(ref, unit), summary.show(ratio, _x),
                     target or "-", _met(summary.median(ratio), target) if target else "-"])

    if "te" not in labels:
        return Table("TorchEstimator against the references (skipped)", ["Figure"], [])
    references = [key for key in ("td_local", "td_barrier") if key in labels]
    for ref in references:
        add("fit wall time, cold", _get("te", "cold", "wall_s"), labels[ref], _get(ref, "cold", "wall_s"), _s, "<=0.7x")
        add("fit wall time, warm", _get("te", "warm", "wall_s"), labels[ref], _get(ref, "warm", "wall_s"), _s, "<=0.5x")
    for ref in references:
        for when in ("cold", "warm"):
            add(f"call to first optimizer step, {when}", _get("te", when, "first_step_s"), labels[ref],
                _get(ref, when, "first_step_s"), _s)
    if "ddp" in labels:
        add("training loop samples/s (warm fit with the probe hook)", _get("te", "warm", "samples_per_s"),
            labels["ddp"], _get("ddp", "samples_per_s"), _rate, ">=0.95x")
        add("training loop samples/s (warm fit, no hook)", _get("te", "warm_no_hook", "samples_per_s"),
            labels["ddp"], _get("ddp", "samples_per_s"), _rate, ">=0.95x")
        add("training loop CPU per sample, rank 0 (with hook)", _get("te", "warm", "cpu_us_per_sample"),
            labels["ddp"], _get("ddp", "cpu_us_per_sample"), _us)
    add("TorchModel.transform rows/s (noop sink)", _get("te", "transform", "rows_per_s"),
        "plain batched forward, 1 process", _get("te", "transform", "plain_forward_rows_per_s"), _rate, ">=0.8x")
    return Table("TorchEstimator against the references",
                 ["Figure", "TorchEstimator", "Reference", "Reference value", "Ratio", "Target", "Met"], rows)


def _per_contender(summary: _Summary, contenders: list[Contender]) -> Table:
    rows = []
    for contender in contenders:
        key = contender.key
        if key in ("plain", "ddp"):
            walls = [summary.show(_get(key, "wall_s"), _s), "-"]
            firsts = [summary.show(_get(key, "first_step_s"), _s), "-"]
            loop = [summary.show(_get(key, "samples_per_s"), _rate), summary.show(_get(key, "cpu_us_per_sample"), _us)]
            rss = _get(key, "peak_rss_mb")
        else:
            walls = [summary.show(_get(key, w, "wall_s"), _s) for w in ("cold", "warm")]
            firsts = [summary.show(_get(key, w, "first_step_s"), _s) for w in ("cold", "warm")]
            loop = [summary.show(_get(key, "warm", "samples_per_s"), _rate),
                    summary.show(_get(key, "warm", "cpu_us_per_sample"), _us)]
            rss = _get(key, "cold", "peak_rss_mb")
        peak = summary.show(_largest(rss), _mb)
        rows.append([contender.label, *walls, *firsts, *loop, peak])
        if key == "te":
            rows.append(_no_hook_row(summary))
    return Table("Every contender (cold = first call in a fresh process and session; warm = the next call)",
                 ["Contender", "wall, cold", "wall, warm", "call to 1st step, cold", "call to 1st step, warm",
                  "loop samples/s (warm)", "loop CPU/sample, rank 0", "peak RSS per rank"], rows)


def _no_hook_row(summary: _Summary) -> list[str]:
    """The warm TorchEstimator fit without hooks, followed through the progress records."""
    return ["TorchEstimator, no hook (progress records)", "-", summary.show(_get("te", "warm_no_hook", "wall_s"), _s),
            "-", summary.show(_get("te", "warm_no_hook", "first_step_s"), _s),
            summary.show(_get("te", "warm_no_hook", "samples_per_s"), _rate), "-", "-"]


def _other(summary: _Summary, workload: Workload, labels: dict[str, str]) -> Table:
    rows = []
    if "te" in labels:
        rows += _hook_rows(summary) + _resume_rows(summary, workload) + _checkpoint_rows(summary) + [
            ["TorchModel.transform rows/s, second call",
             summary.show(_get("te", "transform", "repeat_rows_per_s"), _rate),
             "the model is cached in the reused Python workers"],
            *_transform_floor_rows(summary),
            ["SparkSession start (TorchEstimator's process)", summary.show(_get("te", "session_start_s"), _s),
             "not part of any fit time"],
        ]
    if "ddp" in labels:
        rows += _flag_rows(summary, workload)
    return Table("Other figures", ["Figure", "Value", "How / notes"], rows)


def _transform_floor_rows(summary: _Summary) -> list[list[str]]:
    """What any transform through Spark costs at least, against the plain forward."""
    plain = _get("te", "transform", "plain_forward_rows_per_s")
    rows = []
    for field, figure, how in (
        ("scan_rows_per_s", "Spark alone: the Parquet scan into the noop sink",
         "no Python at all"),
        ("identity_rows_per_s", "Spark + Python: a mapInArrow identity into the noop sink",
         "every row to a Python worker and back, no model"),
    ):
        value = _get("te", "transform", field)
        rows.append([figure, summary.show(value, _rate),
                     f"{summary.show(_ratio(value, plain), _x)} of the plain batched forward; {how}"])
    return rows


def _flag_rows(summary: _Summary, workload: Workload) -> list[list[str]]:
    flag_us = _get("ddp", "flag_allreduce_us")

    def share(results: Round) -> float:
        step_us = workload.batch_size * workload.ranks / results["ddp"]["samples_per_s"] * 1e6
        return flag_us(results) / step_us * 100

    return [[
        "one more all-reduce (2 int32, gloo) per step", summary.show(flag_us, _us),
        f"{summary.show(share, _pct)} of a bare-DDP step; spark_torch_est's loop adds one per step "
        "only when a per-step hook stage takes `control` (Trainer._agree_on_flags)",
    ]]


def _hook_rows(summary: _Summary) -> list[list[str]]:
    with_hook, without = _get("te", "warm", "wall_s"), _get("te", "warm_no_hook", "wall_s")
    return [[
        "warm fit without any hook", summary.show(without, _s),
        f"{summary.show(_ratio(with_hook, without), _x)} of it with the probe hook; loop timed from the driver's "
        "progress records (rank 0's clock, a message at step 1 and then every 0.5 s)",
    ]]


def _resume_rows(summary: _Summary, workload: Workload) -> list[list[str]]:
    def epoch_s(results: Round) -> float:
        """Per-epoch training time of the warm fit, from its first and last step stamps."""
        warm = results["te"]["warm"]
        return warm["loop_s"] * warm["steps"] / (warm["steps"] - 1) / workload.epochs

    def resumed(results: Round) -> float:
        return results["te"]["resume"]["wall_s"]

    def resumed_fixed(results: Round) -> float:
        return resumed(results) - epoch_s(results)

    def fresh_fixed(results: Round) -> float:
        return results["te"]["warm"]["wall_s"] - workload.epochs * epoch_s(results)

    return [[
        "resumed fit of 1 epoch (same estimator, maxEpochs+1)", summary.show(resumed, _s),
        f"per-epoch training in the warm fit {summary.show(epoch_s, _s)}; so the resumed fit's fixed cost is "
        f"{summary.show(resumed_fixed, _s)}, a fresh warm fit's {summary.show(fresh_fixed, _s)}",
    ]]


def _checkpoint_rows(summary: _Summary) -> list[list[str]]:
    def fits(results: Round) -> tuple[dict, dict]:
        return results["te"]["checkpoint"]["big"], results["te"]["checkpoint"]["small"]

    def extra_mb(results: Round) -> float:
        big, small = fits(results)
        return big["checkpoint_mb"] - small["checkpoint_mb"]

    def extra_s(results: Round, field: str = "wall_s") -> float:
        big, small = fits(results)
        return big[field] - small[field]

    def by_fit(results: Round) -> float:
        return extra_mb(results) / extra_s(results)

    def by_tail(results: Round) -> float:
        return extra_mb(results) / extra_s(results, "after_run_to_return_s")

    return [[
        "checkpoint to the driver (approximate)", summary.show(by_fit, _mb_s),
        f"{summary.show(extra_mb, _mb)} more checkpoint (frozen parameters) cost {summary.show(extra_s, _s)} "
        f"more fit time; counted from rank 0's after_run to fit() returning: {summary.show(by_tail, _mb_s)}",
    ]]


def build_tables(rounds: list[Round], workload: Workload, contenders: list[Contender]) -> list[Table]:
    """The headline table, the per-contender table and the other figures."""
    summary = _Summary(rounds)
    labels = {c.key: c.label for c in contenders}
    return [_headline(summary, labels), _per_contender(summary, contenders), _other(summary, workload, labels)]


def load_summary(rounds: list[Round], contenders: list[Contender]) -> tuple[float, str]:
    """The largest share of CPU other processes took during one contender, and where."""
    worst, where = 0.0, "-"
    for number, results in enumerate(rounds, start=1):
        for contender in contenders:
            cores = results.get(contender.key, {}).get("_foreign_cores", 0.0)
            if cores > worst:
                worst, where = cores, f"{contender.label}, round {number}"
    return worst, where
