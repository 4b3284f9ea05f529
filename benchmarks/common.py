"""What every benchmark shares: the workloads and their data, the models, the plain loop the
peers run, the probe hook that times ``TorchEstimator`` fits, the SparkSession, the child
process each contender runs in, and the report's header and tables.

This module travels to executors and torchrun workers by value (:func:`register_by_value`):
they need not have ``benchmarks`` on their path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from spark_torch_est import Hook

RESULT = "BENCH_RESULT "


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """The sizes every contender of one comparison shares.

    ``kind`` is ``"mlp"`` (rows x ``features`` float32 and a float label, MLP
    features-hidden-hidden-1, MSE) or ``"rec"`` (int64 ``user``/``item`` ids far above 2**24
    and ``dense`` floats into hashed embeddings, a 0/1 label, BCE). ``files`` > 0 writes one
    Parquet file per rank with equal rows; 0 writes one file of ``row_group`` rows per row
    group (the ingest table). ``steps`` > 0 makes every fit that many optimizer steps.
    """

    kind: str = "mlp"
    rows: int = 200_000
    features: int = 32
    hidden: int = 256
    epochs: int = 3
    batch_size: int = 256
    ranks: int = 2
    lr: float = 0.01
    seed: int = 0
    files: int = 2
    row_group: int = 1_000_000
    steps: int = 0
    path: str = ""

    @property
    def config(self) -> dict:
        return {"kind": self.kind, "features": self.features, "hidden": self.hidden, "lr": self.lr}

    @property
    def table_mb(self) -> float:
        """The rows as float32 in memory: ``features`` and the label."""
        return self.rows * (self.features + 1) * 4 / 2 ** 20

    @property
    def input_cols(self) -> list[str]:
        return ["user", "item", "dense"] if self.kind == "rec" else ["features"]

    @property
    def label_col(self) -> str:
        return "clicked" if self.kind == "rec" else "label"

    def loss_fn(self) -> nn.Module:
        return nn.BCEWithLogitsLoss() if self.kind == "rec" else nn.MSELoss()

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The seeded model and its optimizer, as every contender builds them."""
        torch.manual_seed(self.seed)
        model = make_model(self.config)
        return model, make_optimizer(model, self.config)

    def describe(self) -> str:
        if self.kind == "rec":
            return (f"{self.rows:,} rows of int64 `user`, `item` (ids above 2**24), `dense` "
                    f"(array<float> of {self.features}), 0/1 label; 2 hashed embeddings 10,000 x 16 + MLP "
                    f"{self.hidden}, BCE, SGD lr {self.lr}, batch {self.batch_size}/rank, {self.epochs} epoch(s), "
                    f"{self.ranks} ranks x 1 thread")
        layout = "one file per rank" if self.files else f"one file of {self.row_group:,}-row row groups"
        length = f"fits of {self.steps} steps" if self.steps else f"{self.epochs} epoch(s)"
        return (f"{self.rows:,} rows x {self.features} float32 (Parquet, {layout}), MLP {self.features}-"
                f"{self.hidden}-{self.hidden}-1, MSE, SGD lr {self.lr}, batch {self.batch_size}/rank, {length}, "
                f"{self.ranks} ranks x 1 thread, local[{self.ranks}]")


class RecModel(nn.Module):
    """Two hashed id embeddings and an MLP of the dense block, scored by a small MLP."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden = config["hidden"]
        self.users, self.items = nn.Embedding(10_000, 16), nn.Embedding(10_000, 16)
        self.dense = nn.Sequential(nn.Linear(config["features"], hidden), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(32 + hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, user: torch.Tensor, item: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.top(torch.cat([self.users(user % 10_000), self.items(item % 10_000), self.dense(dense)], dim=1))


def make_model(config: dict) -> nn.Module:
    """The workload's model: the MLP, or a :class:`RecModel` for ``kind="rec"``."""
    if config.get("kind") == "rec":
        return RecModel(config)
    width = config["hidden"]
    return nn.Sequential(nn.Linear(config["features"], width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 1))


def make_optimizer(model: nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=config["lr"])


# --------------------------------------------------------------------------- data


def _list_array(rows: np.ndarray) -> pa.ListArray:
    offsets = pa.array(np.arange(len(rows) + 1, dtype=np.int32) * rows.shape[1])
    return pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))


def _table(workload: Workload, rng: np.random.Generator, rows: int, w: np.ndarray) -> pa.Table:
    dense = rng.standard_normal((rows, workload.features), dtype=np.float32)
    noise = rng.standard_normal(rows, dtype=np.float32)
    if workload.kind != "rec":
        label = (dense @ w + 0.1 * noise).astype(np.float32)
        return pa.table({"features": _list_array(dense), "label": label})
    user, item = (1 << 40) + rng.integers(0, 1 << 30, rows), (1 << 40) + rng.integers(0, 1 << 20, rows)
    logit = dense @ w + 0.5 * np.cos(user % 101) - 0.5 * np.sin(item % 89)
    clicked = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return pa.table({"user": user, "item": item, "dense": _list_array(dense), "clicked": clicked})


def write_data(workload: Workload, directory: str) -> Workload:
    """Writes the workload's Parquet under ``directory``; returns it with its ``path`` set."""
    path = os.path.join(directory, f"{workload.kind}-{workload.rows}")
    os.makedirs(path)
    rng = np.random.default_rng(workload.seed)
    w = rng.standard_normal(workload.features, dtype=np.float32) / np.sqrt(workload.features)
    if workload.files:
        table = _table(workload, rng, workload.rows, w)
        for part in range(workload.files):
            start, stop = bounds(workload.rows, part, workload.files)
            pq.write_table(table.slice(start, stop - start), os.path.join(path, f"part-{part}.parquet"))
    else:  # one row group at a time, as a large table is written
        first = _table(workload, rng, min(workload.row_group, workload.rows), w)
        with pq.ParquetWriter(os.path.join(path, "part-0.parquet"), first.schema) as writer:
            writer.write_table(first, row_group_size=workload.row_group)
            for start in range(workload.row_group, workload.rows, workload.row_group):
                rows = min(workload.row_group, workload.rows - start)
                writer.write_table(_table(workload, rng, rows, w), row_group_size=workload.row_group)
    for name in os.listdir(path):  # on disk before the first contender runs
        with open(os.path.join(path, name), "rb") as handle:
            os.fsync(handle.fileno())
    return dataclasses.replace(workload, path=path)


def bounds(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share ``[start, stop)``, as the direct read splits a table."""
    return rank * rows // world_size, (rank + 1) * rows // world_size


def read_columns(path: str, columns: list[str]) -> list[np.ndarray]:
    """Every row of ``columns`` read with pyarrow, each copied once into a contiguous array
    (array columns as ``(rows, width)``): what a ``train_fn`` does before ``torch.from_numpy``."""
    table = pq.read_table(path, columns=columns, pre_buffer=False)
    arrays = []
    for name in columns:
        chunks = table.column(name).chunks
        flat = np.concatenate([c.flatten().to_numpy() if pa.types.is_list(c.type) else c.to_numpy() for c in chunks])
        arrays.append(flat.reshape(table.num_rows, -1) if len(flat) > table.num_rows else flat)
    return arrays


def read_rank(workload: Workload, rank: int, world_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Rank ``rank``'s share as ``(inputs, labels (n, 1))``."""
    *inputs, labels = read_columns(workload.path, [*workload.input_cols, workload.label_col])
    start, stop = bounds(len(labels), rank, world_size)
    return tuple(torch.from_numpy(a[start:stop]) for a in inputs), torch.from_numpy(labels[start:stop]).unsqueeze(1)


def final_loss(model: nn.Module, workload: Workload, rows: int = 20_000) -> float:
    """The trained model's loss on the table's first ``rows`` rows: the same work was done
    when every contender ends near the same value."""
    inputs, labels = read_rank(workload, 0, 1)
    model.eval()
    with torch.no_grad():
        return float(workload.loss_fn()(model(*[t[:rows] for t in inputs]), labels[:rows]))


# --------------------------------------------------------------------------- measuring


def _status_mb(field: str, pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith(f"{field}:"))


def rss_mb() -> float:
    return _status_mb("VmRSS")


def peak_rss_mb() -> float:
    """The process's peak RSS since it started or since :func:`reset_peak_rss`."""
    return _status_mb("VmHWM")


def lifetime_peak_rss_mb() -> float:
    """The process's peak RSS since it started, which :func:`reset_peak_rss` leaves alone."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss(pid: int | str = "self") -> None:
    """Sets the peak RSS of process ``pid`` (default this one) back to its current RSS (Linux),
    so a reused worker reports its fit."""
    with suppress(OSError), open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def reset_peaks_below() -> dict[int, float]:
    """Resets the peak RSS of every process below this one (the JVM, its Python daemon and
    workers) and returns the RSS in MB of each by process id: what a Python worker holds
    before the next job gives it a task."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    below, rss = [os.getpid()], {}
    while below:
        pid = below.pop()
        for child in (child for child, parent in parents.items() if parent == pid):
            below.append(child)
            reset_peak_rss(child)
            with suppress(OSError, StopIteration):
                rss[child] = _status_mb("VmRSS", child)
    return rss


def prefault(workload: Workload) -> None:
    """Touches and frees three times the workload's rows and 512 MB: this VM hands freed pages
    back to its host after a few seconds and a fresh page then costs ~2 s per GB, so the timed
    allocations of the ingest figures (pyarrow's and the ranks') find backed pages alike."""
    block = np.empty(int((3 * workload.table_mb + 512) * 2 ** 20), dtype=np.uint8)
    block[::4096] = 1


class Clock:
    """Stamps of the optimizer steps of one rank: wall and CPU time, samples of all ranks."""

    def __init__(self) -> None:
        self.first = self.last = self.cpu_first = self.cpu_last = 0.0
        self.samples_first = self.samples_last = self.steps = 0

    def step(self, samples: int) -> None:
        now, cpu = time.time(), time.process_time()
        if not self.steps:
            self.first, self.cpu_first, self.samples_first = now, cpu, samples
        self.last, self.cpu_last, self.samples_last, self.steps = now, cpu, samples, self.steps + 1

    def figures(self, called: float) -> dict:
        """``first_step_s`` after ``called``; ``samples_per_s`` (all ranks) and
        ``cpu_us_per_sample`` (this rank's CPU over all ranks' samples) between the first and
        the last step."""
        samples = self.samples_last - self.samples_first
        timed = self.steps > 1 and samples > 0
        return {"first_step_s": self.first - called,
                "samples_per_s": samples / (self.last - self.first) if timed else None,
                "cpu_us_per_sample": (self.cpu_last - self.cpu_first) * 1e6 / samples if timed else None}


def plain_train(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: tuple[torch.Tensor, ...],
                labels: torch.Tensor, loss_fn: nn.Module, *, epochs: int, batch_size: int, seed: int, rank: int = 0,
                world_size: int = 1, autocast: torch.dtype | None = None, clock: Clock | None = None) -> Clock:
    """The loop the peers run: a seeded shuffle per epoch, zero_grad/forward/backward/step,
    ``model(*inputs)``, forward and loss under ``torch.autocast`` when given a dtype."""
    clock = clock or Clock()
    model.train()
    for epoch in range(epochs):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch + rank))
        for start in range(0, len(labels), batch_size):
            rows = order[start:start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(labels.device.type, dtype=autocast, enabled=autocast is not None):
                loss = loss_fn(model(*[tensor[rows] for tensor in inputs]), labels[rows])
            loss.backward()
            optimizer.step()
            clock.step(clock.samples_last + len(rows) * world_size)
    return clock


class Probe(Hook):
    """Times a fit from inside its ranks through the public hook API. At ``after_run`` each rank
    writes to ``<directory>/<tag>-rank<r>.json`` its step stamps, its process id, its RSS, peak RSS
    (since the last reset) and lifetime peak RSS at its first step, the time since its last epoch
    ended (the final checkpoint's), its peak RSS and where it imported ``spark_torch_est`` from.
    ``last_epoch`` times the last epoch's steps alone."""

    def __init__(self, directory: str, tag: str, last_epoch: bool = False) -> None:
        self.directory, self.tag, self.last_epoch = directory, tag, last_epoch
        self.clock, self.first, self.epoch_end, self.at_first_step = Clock(), 0.0, 0.0, {}

    def before_train_epoch(self) -> None:
        if self.last_epoch:
            self.clock = Clock()

    def after_train_iter(self, state) -> None:
        self.clock.step(state.samples)
        if not self.first:
            self.first = self.clock.first
            self.at_first_step = {"first_step_rss_mb": rss_mb(), "first_step_lifetime_peak_mb": lifetime_peak_rss_mb(),
                                  "first_step_peak_mb": peak_rss_mb(), "pid": os.getpid()}

    def after_train_epoch(self) -> None:
        self.epoch_end = time.time()

    def after_run(self, rank: int) -> None:
        import spark_torch_est

        report = {**vars(self.clock), **self.at_first_step, "fit_first": self.first, "peak_rss_mb": peak_rss_mb(),
                  "after_last_epoch_s": time.time() - self.epoch_end,
                  "package": os.path.dirname(spark_torch_est.__file__)}
        Path(self.directory, f"{self.tag}-rank{rank}.json").write_text(json.dumps(report))
        reset_peak_rss()

    def reports(self, ranks: int) -> list[dict]:
        """Each rank's report; checks that the ranks ran the driver's ``spark_torch_est``."""
        import spark_torch_est

        reports = [json.loads(Path(self.directory, f"{self.tag}-rank{rank}.json").read_text()) for rank in range(ranks)]
        here = os.path.dirname(spark_torch_est.__file__)
        if any(r["package"] != here for r in reports):
            raise RuntimeError(f"the ranks imported spark_torch_est from {reports[0]['package']}, the driver from "
                               f"{here}: set BENCH_PACKAGE (see benchmarks/__init__.py)")
        return reports

    def read(self, ranks: int, called: float) -> dict:
        """Rank 0's figures after ``called`` and the largest rank's peak RSS."""
        reports = self.reports(ranks)
        clock = Clock()
        vars(clock).update({k: v for k, v in reports[0].items() if k in vars(clock)})
        return {**clock.figures(called), "first_step_s": reports[0]["fit_first"] - called,
                "peak_rss_mb": max(r["peak_rss_mb"] for r in reports)}


def register_by_value(*modules) -> None:
    """Ships ``modules`` (and this one) by value to executors and torchrun workers, through
    both cloudpickles (``spark_torch_est`` pickles creators with the standalone one,
    ``mapInArrow`` and TorchDistributor with pyspark's)."""
    import cloudpickle
    from pyspark import cloudpickle as spark_cloudpickle

    for module in (sys.modules[__name__], *modules):
        cloudpickle.register_pickle_by_value(module)
        spark_cloudpickle.register_pickle_by_value(module)


@contextmanager
def spark_session(ranks: int, app: str, **conf: str) -> Iterator:
    """A fresh ``local[ranks]`` session, stopped for real at the end: the JVM has exited before
    the next contender starts."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(f"local[{ranks}]").appName(app).config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false").config("spark.sql.shuffle.partitions", str(ranks)))
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield spark
    finally:
        gateway = SparkContext._gateway
        process = getattr(gateway, "proc", None)
        spark.stop()
        if gateway is not None:
            gateway.shutdown()
        if process is not None:
            process.stdin.close()  # the JVM exits when its stdin closes
            process.wait(timeout=60)
        SparkContext._gateway = SparkContext._jvm = None


def run_child(module: str, *args: str, timeout_s: float = 600, package: str | None = None) -> dict:
    """Runs ``python -m benchmarks.<module> args...`` in a fresh process (a cold start is a
    fresh process) and returns the JSON it printed after :data:`RESULT`; ``package``: the
    checkout it imports ``spark_torch_est`` from (``BENCH_PACKAGE``, default this run's)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "BENCH_PACKAGE": package} if package else None
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=root, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise RuntimeError(f"benchmarks.{module} {' '.join(args)[:80]} failed (exit {done.returncode}):\n{tail}")
    return json.loads(lines[-1][len(RESULT):])


def show(values: list[float], unit: str = "") -> str:
    """Median, then ``[min-max]`` when there are several: ``1.23 s [1.10-1.40]``."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    middle = statistics.median(values)
    digits = 0 if middle >= 1000 or all(isinstance(v, int) for v in values) else 3 if middle < 1 else 2
    text = f"{middle:,.{digits}f}{unit}"
    return text + (f" [{min(values):,.{digits}f}-{max(values):,.{digits}f}]" if len(values) > 1 else "")


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


def run_header(module: str, *facts: str) -> str:
    """A report's first lines: when, the command line, then the machine and ``facts`` as a list."""
    command = shlex.join(["python", "-m", module, *sys.argv[1:]])
    return f"Run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: `{command}`\n\n" + "".join(
        f"- {fact}\n" for fact in (machine(), *facts))


def write_docs(text: str, block: str, path: Path = Path(__file__).resolve().parent.parent / "docs/benchmarks.md"):
    """Replaces the text between ``<!-- block:start -->`` and ``<!-- block:end -->`` in ``path``."""
    start, end = f"<!-- {block}:start -->", f"<!-- {block}:end -->"
    page = path.read_text()
    if start not in page:
        page += f"\n{start}\n{end}\n"
    before, rest = page.split(start, 1)
    path.write_text(f"{before}{start}\n\n{text.strip()}\n\n{end}{rest.split(end, 1)[1]}")


def machine() -> str:
    """One line: cores, versions, load average, the measured package."""
    import pyarrow
    import pyspark

    import spark_torch_est

    return (f"{len(os.sched_getaffinity(0))} cores, Python {sys.version.split()[0]}, torch {torch.__version__}, "
            f"pyspark {pyspark.__version__}, pyarrow {pyarrow.__version__}; load average "
            f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; spark_torch_est from "
            f"{os.path.dirname(spark_torch_est.__file__)}")


def add_baseline(parser: argparse.ArgumentParser) -> None:
    """The ``--baseline CHECKOUT`` option (see :func:`baseline_of`)."""
    parser.add_argument("--baseline", metavar="CHECKOUT",
                        help="also run each TorchEstimator contender on this checkout's package, side by side")


def baseline_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """``--baseline``'s checkout as an absolute path, or None; a usage error unless it holds the package."""
    baseline = args.baseline and os.path.abspath(args.baseline)
    if baseline and not os.path.isfile(os.path.join(baseline, "spark_torch_est", "__init__.py")):
        parser.error(f"--baseline {args.baseline}: no spark_torch_est package there")
    return baseline or None
