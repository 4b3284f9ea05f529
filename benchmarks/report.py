"""Turns the rounds' raw results into the tables the suite prints (and writes to docs):
the reference workload's tables here, the typed-input and ingest ones in
:mod:`benchmarks.report_typed` and :mod:`benchmarks.report_ingest` (see
:mod:`benchmarks.tables` for how figures are summarised over rounds).
"""

from __future__ import annotations

from typing import Callable

from benchmarks.report_ingest import ingest_tables
from benchmarks.report_typed import typed_table
from benchmarks.suite import Contender
from benchmarks.tables import (COMPARISON_HEADER, Pick, Round, Summary, Table, get, largest, mb, mb_s, pct, rate, ratio,
                               seconds, times, us)
from benchmarks.workload import WorkloadBase, Workload

__all__ = ["build_tables", "load_summary"]


def _headline(summary: Summary, labels: dict[str, str]) -> Table:
    rows: list[list[str]] = []

    def add(figure: str, ours: Pick, reference: str, ref: Pick, unit: Callable[[float], str], target: str = "") -> None:
        rows.append(summary.compare(figure, ours, reference, ref, unit, target))

    if "te" not in labels:
        return Table("TorchEstimator against the references (skipped)", ["Figure"], [])
    references = [key for key in ("td_local", "td_barrier") if key in labels]
    for ref in references:
        for when, target in (("cold", "<=0.7x"), ("warm", "<=0.5x")):
            add(f"fit wall time, {when}", get("te", when, "wall_s"), labels[ref], get(ref, when, "wall_s"), seconds,
                target)
    for ref in references:
        for when in ("cold", "warm"):
            add(f"call to first optimizer step, {when}", get("te", when, "first_step_s"), labels[ref],
                get(ref, when, "first_step_s"), seconds)
    if "ddp" in labels:
        add("training loop samples/s (warm fit with the probe hook)", get("te", "warm", "samples_per_s"),
            labels["ddp"], get("ddp", "samples_per_s"), rate, ">=0.95x")
        add("training loop samples/s (warm fit, no hook)", get("te", "warm_no_hook", "samples_per_s"),
            labels["ddp"], get("ddp", "samples_per_s"), rate, ">=0.95x")
        add("training loop CPU per sample, rank 0 (with hook)", get("te", "warm", "cpu_us_per_sample"),
            labels["ddp"], get("ddp", "cpu_us_per_sample"), us)
    add("TorchModel.transform rows/s (noop sink)", get("te", "transform", "rows_per_s"),
        "plain batched forward, 1 process", get("te", "transform", "plain_forward_rows_per_s"), rate, ">=0.8x")
    return Table("TorchEstimator against the references", COMPARISON_HEADER, rows)


def _per_contender(summary: Summary, contenders: list[Contender]) -> Table:
    rows = []
    for contender in contenders:
        key = contender.key
        if key in ("plain", "ddp"):
            walls = [summary.show(get(key, "wall_s"), seconds), "-"]
            firsts = [summary.show(get(key, "first_step_s"), seconds), "-"]
            loop = [summary.show(get(key, "samples_per_s"), rate), summary.show(get(key, "cpu_us_per_sample"), us)]
            rss = get(key, "peak_rss_mb")
        else:
            walls = [summary.show(get(key, w, "wall_s"), seconds) for w in ("cold", "warm")]
            firsts = [summary.show(get(key, w, "first_step_s"), seconds) for w in ("cold", "warm")]
            loop = [summary.show(get(key, "warm", "samples_per_s"), rate),
                    summary.show(get(key, "warm", "cpu_us_per_sample"), us)]
            rss = get(key, "cold", "peak_rss_mb")
        peak = summary.show(largest(rss), mb)
        rows.append([contender.label, *walls, *firsts, *loop, peak])
        if key == "te":
            rows.append(_no_hook_row(summary))
    return Table("Every contender (cold = first call in a fresh process and session; warm = the next call)",
                 ["Contender", "wall, cold", "wall, warm", "call to 1st step, cold", "call to 1st step, warm",
                  "loop samples/s (warm)", "loop CPU/sample, rank 0", "peak RSS per rank"], rows)


def _no_hook_row(summary: Summary) -> list[str]:
    """The warm TorchEstimator fit without hooks, followed through the progress records."""
    return ["TorchEstimator, no hook (progress records)", "-",
            summary.show(get("te", "warm_no_hook", "wall_s"), seconds),
            "-", summary.show(get("te", "warm_no_hook", "first_step_s"), seconds),
            summary.show(get("te", "warm_no_hook", "samples_per_s"), rate), "-", "-"]


def _other(summary: Summary, workload: Workload, labels: dict[str, str]) -> Table:
    rows = []
    if "te" in labels:
        rows += _hook_rows(summary) + _resume_rows(summary, workload) + _checkpoint_rows(summary) + [
            ["TorchModel.transform rows/s, second call",
             summary.show(get("te", "transform", "repeat_rows_per_s"), rate),
             "the model is cached in the reused Python workers"],
            *_transform_floor_rows(summary),
            ["SparkSession start (TorchEstimator's process)", summary.show(get("te", "session_start_s"), seconds),
             "not part of any fit time"],
        ]
    if "ddp" in labels:
        rows += _flag_rows(summary, workload)
    return Table("Other figures", ["Figure", "Value", "How / notes"], rows)


def _transform_floor_rows(summary: Summary) -> list[list[str]]:
    """What any transform through Spark costs at least, against the plain forward."""
    plain = get("te", "transform", "plain_forward_rows_per_s")
    rows = []
    for field, figure, how in (
        ("scan_rows_per_s", "Spark alone: the Parquet scan into the noop sink",
         "no Python at all"),
        ("identity_rows_per_s", "Spark + Python: a mapInArrow identity into the noop sink",
         "every row to a Python worker and back, no model"),
    ):
        value = get("te", "transform", field)
        rows.append([figure, summary.show(value, rate),
                     f"{summary.show(ratio(value, plain), times)} of the plain batched forward; {how}"])
    return rows


def _flag_rows(summary: Summary, workload: Workload) -> list[list[str]]:
    flag_us = get("ddp", "flag_allreduce_us")

    def share(results: Round) -> float:
        step_us = workload.batch_size * workload.ranks / results["ddp"]["samples_per_s"] * 1e6
        return flag_us(results) / step_us * 100

    return [[
        "one more all-reduce (2 int32, gloo) per step", summary.show(flag_us, us),
        f"{summary.show(share, pct)} of a bare-DDP step; spark_torch_est's loop adds one per step "
        "only when a per-step hook stage takes `control` (Trainer._agree_on_flags)",
    ]]


def _hook_rows(summary: Summary) -> list[list[str]]:
    with_hook, without = get("te", "warm", "wall_s"), get("te", "warm_no_hook", "wall_s")
    return [[
        "warm fit without any hook", summary.show(without, seconds),
        f"{summary.show(ratio(with_hook, without), times)} of it with the probe hook; loop timed from the driver's "
        "progress records (rank 0's clock, a message at step 1 and then every 0.5 s)",
    ]]


def _resume_rows(summary: Summary, workload: Workload) -> list[list[str]]:
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
        "resumed fit of 1 epoch (same estimator, maxEpochs+1)", summary.show(resumed, seconds),
        f"per-epoch training in the warm fit {summary.show(epoch_s, seconds)}; so the resumed fit's fixed cost is "
        f"{summary.show(resumed_fixed, seconds)}, a fresh warm fit's {summary.show(fresh_fixed, seconds)}",
    ]]


def _checkpoint_rows(summary: Summary) -> list[list[str]]:
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
        "checkpoint to the driver (approximate)", summary.show(by_fit, mb_s),
        f"{summary.show(extra_mb, mb)} more checkpoint (frozen parameters) cost {summary.show(extra_s, seconds)} "
        f"more fit time; counted from rank 0's after_run to fit() returning: {summary.show(by_tail, mb_s)}",
    ]]


def build_tables(rounds: list[Round], workloads: dict[str, WorkloadBase], contenders: list[Contender]) -> list[Table]:
    """The reference workload's headline table, per-contender table and other figures,
    then the typed-inputs table and the ingest tables (each where its contenders ran)."""
    summary = Summary(rounds)
    labels = {c.key: c.label for c in contenders}
    tables = []
    reference = [c for c in contenders if c.workload == "reference"]
    if reference:
        workload = workloads["reference"]
        tables += [_headline(summary, labels), _per_contender(summary, reference), _other(summary, workload, labels)]
    typed = typed_table(summary, labels)
    if typed is not None:
        tables.append(typed)
    if "ingest" in workloads:
        tables += ingest_tables(summary, workloads["ingest"], labels)
    return tables


def load_summary(rounds: list[Round], contenders: list[Contender]) -> tuple[float, str]:
    """The largest share of CPU other processes took during one contender, and where."""
    worst, where = 0.0, "-"
    for number, results in enumerate(rounds, start=1):
        for contender in contenders:
            cores = results.get(contender.key, {}).get("_foreign_cores", 0.0)
            if cores > worst:
                worst, where = cores, f"{contender.label}, round {number}"
    return worst, where
