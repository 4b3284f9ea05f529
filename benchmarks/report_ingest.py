"""The ingest table: call to first step on a large table against pyarrow reading it, and a
rank's memory against its share of the data."""

from __future__ import annotations

from benchmarks.tables import COMPARISON_HEADER, Round, Summary, Table, get, largest, mb, rate, ratio, seconds, times
from benchmarks.workload import IngestWorkload

__all__ = ["ingest_tables", "faster_read", "RSS_SLACK_MB"]

_PYARROW = "pyarrow reading the same files into numpy, 1 process (the faster read)"
_READS = ("ingest_pyarrow", "ingest_pyarrow_default")
_FORWARD = "plain batched forward of the same rows as numpy, 1 process, every core"
_SHARE = "its share of the data (features + label, float32)"
RSS_SLACK_MB = 400  # the memory target: at most 1.5x the share + 400 MB (torch, Python, one batch in flight)


def ingest_tables(summary: Summary, workload: IngestWorkload, labels: dict[str, str]) -> list[Table]:
    """The comparison table and the other ingest figures; empty when the ingest contenders did not both run."""
    if not {"ingest_te", "ingest_pyarrow"} <= set(labels):
        return []
    read = faster_read
    rows = [summary.compare(figure, get("ingest_te", fit, "first_step_s"), _PYARROW, read, seconds, target)
            for figure, fit, target in (
                ("warm call to first optimizer step, direct read (goal: 1.5x)", "warm", "<=2.0x"),
                ("warm call to first step, unchanged files (a worker given its part again reuses it)", "reuse", ""),
                ("cold call to first optimizer step, direct read", "cold", ""),
                ("warm call to first optimizer step, directRead=False (through Spark)", "spark", ""),
                ("first fit on df.cache() (through Spark; fills the cache), call to first step", "cache_first", ""),
                ("second fit on the same cached DataFrame, call to first step", "cache_second", ""),
            )]
    share = workload.share_mb
    rows.append(_rss_row(summary, "largest rank's peak RSS, cold fit, direct read (the process's whole life)",
                         "cold", share, target=True))
    rows.append(_rss_row(summary, "largest rank's peak RSS during the warm fit through Spark (reused worker)",
                         "spark", share, target=False))
    for figure, path, target in (("TorchModel.transform rows/s, the tasks read the files (noop sink)", "files", ">=0.5x"),
                                 ("TorchModel.transform rows/s, through Spark's scan (directRead=False)", "spark", "")):
        rows.append(summary.compare(figure, get("ingest_te", "transform", f"{path}_rows_per_s"), _FORWARD,
                                    get("ingest_te", "transform", "plain_forward_rows_per_s"), rate, target))
    partitions = summary.show(get("ingest_te", "partitions"), lambda value: f"{value:.0f}")
    parquet = summary.show(get("ingest_pyarrow", "parquet_mb"), mb)
    title = (f"Ingest at scale: {workload.rows:,} rows x {workload.features} float32 ({parquet} of Parquet, one "
             f"file, {workload.row_group_rows:,}-row row groups: {partitions} Spark partitions); fits of "
             f"{workload.steps} steps")
    return [Table(title, COMPARISON_HEADER, rows), _other(summary)]


def _rss_row(summary: Summary, figure: str, fit: str, share: float, target: bool) -> list[str]:
    row = summary.compare(figure, largest(get("ingest_te", fit, "peak_rss_mb")), _SHARE, lambda _: share, mb)
    if target:
        bound = 1.5 * share + RSS_SLACK_MB
        peak = summary.median(largest(get("ingest_te", fit, "peak_rss_mb")))
        row[-2:] = [f"<=1.5x + {RSS_SLACK_MB} MB = {bound:,.0f} MB", "n/a" if peak is None else
                    "yes" if peak <= bound else "NO"]
    return row


def faster_read(results: Round) -> float:
    """The faster of the round's two pyarrow reads (``pre_buffer`` False and True)."""
    return min(results[key]["read_s"] for key in _READS if key in results and "read_s" in results[key])


def _other(summary: Summary) -> Table:
    walls = ", ".join(f"{name} {summary.show(get('ingest_te', fit, 'wall_s'), seconds)}" for name, fit in (
        ("cold", "cold"), ("warm", "warm"), ("unchanged files", "reuse"), ("through Spark", "spark"), ("1st on df.cache()", "cache_first"),
        ("2nd on df.cache()", "cache_second")))
    pyarrow_rss, data = get("ingest_pyarrow", "peak_rss_mb"), get("ingest_pyarrow", "data_mb")
    lean, default = get("ingest_pyarrow", "read_s"), get("ingest_pyarrow_default", "read_s")
    rows = [
        ["fit wall times (call to return)", walls, "each fit trains its steps after the ingest"],
        ["pyarrow reads into numpy: pq.read_table(pre_buffer=False) / with its defaults",
         f"{summary.show(lean, seconds)} / {summary.show(default, seconds)}",
         f"each the first read of a fresh process; the reference above is the faster of the two in each round; "
         f"defaults / pre_buffer=False: {summary.show(ratio(default, lean), times)}"],
        ["pyarrow process's peak RSS (pre_buffer=False)", summary.show(pyarrow_rss, mb),
         f"{summary.show(get('ingest_pyarrow', 'rss_before_mb'), mb)} before the read (Python, torch, pyarrow "
         f"imported); the table in numpy: {summary.show(data, mb)}"],
        ["SparkSession start (the ingest contender's process)",
         summary.show(get("ingest_te", "session_start_s"), seconds), "not part of any fit time"],
    ]
    return Table("Ingest: other figures", ["Figure", "Value", "How / notes"], rows)
