"""Creators and hooks shared by tests; pickled by value, as if defined in a notebook."""

from __future__ import annotations

import gc
import os
import textwrap
import threading
import time
from pathlib import Path

import cloudpickle
import numpy as np
import pyarrow as pa
import torch
from torch import nn

from spark_torch_est import Hook, TorchEstimator
from spark_torch_est.core.progress import Target
from spark_torch_est.core.protocol import FEATURES, IS_VALIDATION, LABEL
from spark_torch_est.core.schema import FEATURES_LAYOUT, InputColumn, InputSchema
from spark_torch_est.core.spec import Launch, TaskSpec
from spark_torch_est.train.creators import Creators
from spark_torch_est.train.hooks import normalize_hooks


def linear_model(config: dict) -> nn.Module:
    return nn.Linear(config.get("in_features", 8), 1)


def mlp(config: dict) -> nn.Module:
    width = config.get("width", 16)
    return nn.Sequential(nn.Linear(config.get("in_features", 8), width), nn.ReLU(),
                         nn.Dropout(config.get("dropout", 0.0)), nn.Linear(width, 1))


def sgd(model: nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.05))


def adam(model: nn.Module, config: dict) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=config.get("lr", 0.01))


def step_lr(optimizer: torch.optim.Optimizer, config: dict):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


def flat_weights(source) -> np.ndarray:
    """Every weight in one flat array, from a module, a Checkpoint, or what holds one
    (a TorchModel, a fitted TorchEstimator)."""
    state = source.state_dict() if isinstance(source, nn.Module) else getattr(source, "checkpoint", source).model_state
    return torch.cat([v.detach().reshape(-1) for v in state.values()]).numpy()


class DumpWeights(Hook):
    """Writes each rank's final weights to ``<directory>/rank<r>.npy``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def after_run(self, model, rank):
        np.save(os.path.join(self.directory, f"rank{rank}.npy"), flat_weights(model))


class CountSteps(Hook):
    """Counts the fits it saw start (``runs``) and the steps they trained (``steps``)."""

    def __init__(self, start: int = 0) -> None:
        self.steps = start
        self.runs = 0

    def before_run(self):
        self.runs += 1

    def after_train_iter(self):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps, "runs": self.runs}

    def load_state_dict(self, state):
        self.steps, self.runs = state["steps"], state["runs"]


class CrashOnce(Hook):
    """Hard-exits rank 1's Python worker after batch ``batch`` of epoch ``epoch`` (0-based
    completed epochs), the first time only (``marker`` remembers it); with ``wait_for``,
    only once that file exists (or after 20 s)."""

    def __init__(self, marker: str, epoch: int = 2, batch: int = 4, wait_for: str | None = None) -> None:
        self.marker, self.epoch, self.batch, self.wait_for = marker, epoch, batch, wait_for

    def after_train_iter(self, rank, state):
        if (rank == 1 and state.epoch == self.epoch and state.batch_in_epoch == self.batch
                and not os.path.exists(self.marker)):
            deadline = time.monotonic() + 20
            while self.wait_for and not os.path.exists(self.wait_for) and time.monotonic() < deadline:
                time.sleep(0.05)  # polling the other side's file, with a deadline
            open(self.marker, "w").close()
            os._exit(3)


class SeenRows(Hook):
    """Appends the ids of the rows each rank trains on (the labels, or with ``first_input``
    the first input column, as integers) to ``<directory>/epoch<e>-rank<r>-<pid>``; read
    them back with :func:`seen_rows`."""

    def __init__(self, directory: str, first_input: bool = False) -> None:
        self.directory, self.first_input = directory, first_input

    def after_train_iter(self, labels, inputs, rank, epoch):
        ids = inputs[0] if self.first_input else labels
        with open(os.path.join(self.directory, f"epoch{epoch}-rank{rank}-{os.getpid()}"), "a") as out:
            out.write("".join(f"{int(v)}\n" for v in ids.reshape(-1).tolist()))


def seen_rows(directory, epoch: int) -> list[int]:
    """The sorted ids :class:`SeenRows` saw in ``epoch``, all ranks and processes together."""
    return sorted(int(line) for path in Path(directory).glob(f"epoch{epoch}-*") for line in path.read_text().split())


def estimator(*presets: dict, **params) -> TorchEstimator:
    """The tests' estimator: an MLP on 8 features with Adam and a StepLR schedule, 2 ranks,
    no progress bar; ``presets`` (a test module's settings), then ``params``, override any
    argument."""
    settings = dict(model=mlp, optimizer=adam, scheduler=step_lr, loss=torch.nn.MSELoss(),
                    config={"dropout": 0.2, "lr": 0.01}, batchSize=128, maxEpochs=4, numWorkers=2, seed=11,
                    showProgress=False)
    for preset in presets:
        settings.update(preset)
    return TorchEstimator(**{**settings, **params})


def linear_estimator(*presets: dict, **params) -> TorchEstimator:
    """The tests' linear regression: ``Linear(8, 1)`` (``config["in_features"]`` inputs) with
    SGD, 2 ranks, batches of 64, 4 epochs, no progress bar; ``presets`` (a test module's
    settings), then ``params``, override any argument."""
    settings = dict(model=linear_model, optimizer=sgd, loss=torch.nn.MSELoss(), batchSize=64, maxEpochs=4,
                    numWorkers=2, showProgress=False)
    for preset in presets:
        settings.update(preset)
    return TorchEstimator(**{**settings, **params})


def task_spec(target: Target = Target(epoch=1), *, hooks=None, creators: Creators | None = None,
              **fields) -> TaskSpec:
    """A one-rank TaskSpec for the loop run in-process (``LocalBarrier``); ``fields``
    override TaskSpec fields."""
    creators = creators or Creators(model=mlp, optimizer=adam, loss=torch.nn.MSELoss(), scheduler=step_lr,
                                    hooks=normalize_hooks(hooks), config={"dropout": 0.3})
    settings = dict(run_id="0123456789abcdef", fit_id="f", payload=cloudpickle.dumps(creators), resume=None,
                    target=target,
                    schema=features_schema(8), world_size=1, batch_size=16, seed=3, timeout_s=30)
    settings.update(fields)
    return TaskSpec(**settings)


def train_locally(target: Target = Target(epoch=1), resume: bytes | None = None, *, rows: int = 200,
                  **fields):
    """Runs one rank of the real loop in this process (``LocalBarrier``) on
    ``arrow_batches(rows)``; ``fields`` go to :func:`task_spec`. Returns the Checkpoint."""
    from spark_torch_est import Checkpoint
    from spark_torch_est.cluster.barrier import LocalBarrier
    from spark_torch_est.cluster.worker import run_rank

    spec = task_spec(target, resume=resume, **fields)
    return Checkpoint.from_bytes(run_rank(spec, LOCAL_LAUNCH, iter(arrow_batches(rows)), LocalBarrier()))


def features_schema(width: int, name: str = "features") -> InputSchema:
    """The input schema of a float features column of ``width`` values per row."""
    return InputSchema(FEATURES_LAYOUT, (InputColumn(name, "float32", 1, "array<float>"),))


#: A Launch for a lone rank (no store, no channel).
LOCAL_LAUNCH = Launch(job_id="unit", secret=b"s" * 32)


def features_batches(rows: int, width: int = 16, per_batch: int = 1000, seed: int = 0,
                     validation_every: int | None = None):
    """Training-frame batches of random features, a label and (every ``validation_every``th
    row) validation flags, as the tasks receive them."""
    rng = np.random.default_rng(seed)
    for start in range(0, rows, per_batch):
        n = min(per_batch, rows - start)
        x = rng.normal(size=(n, width)).astype(np.float32)
        arrays = [pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), width), pa.array(x.sum(axis=1))]
        names = [FEATURES, LABEL]
        if validation_every:
            arrays.append(pa.array(np.arange(start, start + n) % validation_every == 0))
            names.append(IS_VALIDATION)
        yield pa.RecordBatch.from_arrays(arrays, names)


def with_column(batch: pa.RecordBatch, name: str, values: pa.Array, at: int | None = None) -> pa.RecordBatch:
    """``batch`` with ``values`` as its column ``name``, appended or in place of column ``at``
    (``RecordBatch.append_column`` and ``set_column`` are pyarrow 15's; the matrix starts at 14)."""
    columns, names = list(batch.columns), list(batch.schema.names)
    if at is None:
        columns.append(values)
        names.append(name)
    else:
        columns[at], names[at] = values, name
    return pa.RecordBatch.from_arrays(columns, names=names)


def arrow_batches(rows: int = 200, seed: int = 0, width: int = 8) -> list[pa.RecordBatch]:
    """Training-frame batches of y = sum(x) + 1, as the tasks receive them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, width)).astype(np.float32)
    y = (x.sum(axis=1) + 1.0).astype(np.float32)
    features = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), width)
    return [pa.RecordBatch.from_arrays([features, pa.array(y)], [FEATURES, LABEL])]


import sys  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def spark_jobs_started(spark) -> int:
    """How many jobs the session's scheduler has started (to assert that none was)."""
    next_id = spark.sparkContext._jsc.sc().dagScheduler().nextJobId()
    return int(next_id if isinstance(next_id, int) else next_id.get())


def listening_ports(pid: int) -> set[int]:
    """TCP ports on which process ``pid`` listens (from /proc, Linux only)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports

#: An outsider's attack on a rendezvous store's port (argv[1]): 60 values of 7 MB as a
#: TCPStore client, 420 MB of raw bytes on one connection, then 3,000 idle connections;
#: prints what got through ("<values written> <MB sent> <connections opened>") and keeps
#: the connections open until its stdin closes.
STORE_FLOOD = textwrap.dedent("""
    import socket, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    port = int(sys.argv[1])
    written = 0
    try:  # 60 values of 7 MB, as a TCPStore client
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
        for i in range(60):
            store.set(f"junk/{i}", b"x" * (7 << 20))
            written += 1
    except Exception:
        pass
    sent = 0
    try:  # 420 MB of raw bytes on one connection
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for _ in range(60):
                sock.sendall(b"x" * (7 << 20))
                sent += 7
    except OSError:
        pass
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3000)]
    print(written, sent, len(idle), flush=True)
    sys.stdin.readline()  # the connections stay open until the test has measured
""")


def rss_mb(pid: int | str = "self") -> float:
    """Resident memory of process ``pid`` in MB (from /proc, Linux only)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def worker_jvm(pid: int) -> int:
    """The standalone worker JVM above a process (python worker -> daemon -> executor -> worker)."""
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"org.apache.spark.deploy.worker.Worker" in f.read():
                return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError("not under a standalone worker")


def descendants(pid: int) -> set[int]:
    """All live descendant process ids of ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def tasks_read_files(frame) -> bool:
    """Whether the tasks of ``frame`` read its Parquet files themselves: Spark's plan scans no
    files, only the part numbers (a Range)."""
    plan = frame._jdf.queryExecution().executedPlan().toString()
    return "FileScan" not in plan and "Range (" in plan


FEATURE_LAYOUTS = ["vector_dense", "vector_sparse", "array_double", "array_float", "feature_cols", "numeric"]


def layout_data(width: int, rows: int = 300) -> tuple[np.ndarray, np.ndarray]:
    """Linear data ``(x, y)`` with many zeros in ``x`` (so sparse vectors really are sparse)."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(rows, width))
    x[rng.random(size=x.shape) < 0.4] = 0.0
    return x, x @ rng.normal(size=width) + 0.3


def layout_frame(spark, layout: str, x: np.ndarray, y: np.ndarray):
    """``(id, label, features...)`` with the features in one of FEATURE_LAYOUTS ("numeric" takes
    the first column only); returns the DataFrame and the Params that read it."""
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import functions as F

    if layout == "feature_cols":
        names = [f"f{j}" for j in range(x.shape[1])]
        rows = [(i, float(t), *map(float, r)) for i, (r, t) in enumerate(zip(x, y))]
        return spark.createDataFrame(rows, ["id", "label", *names]), {"featuresCol": None, "featureCols": names}
    if layout == "numeric":
        rows = [(i, float(t), float(r[0])) for i, (r, t) in enumerate(zip(x, y))]
        return spark.createDataFrame(rows, ["id", "label", "x"]), {"featuresCol": "x"}
    if layout == "vector_dense":
        values = [Vectors.dense(r.tolist()) for r in x]
    elif layout == "vector_sparse":
        values = [Vectors.sparse(len(r), {j: float(v) for j, v in enumerate(r) if v}) for r in x]
    else:
        values = [r.tolist() for r in x]
    df = spark.createDataFrame([(i, float(t), v) for i, (v, t) in enumerate(zip(values, y))], ["id", "label", "vec"])
    if layout == "array_float":
        df = df.withColumn("vec", F.col("vec").cast("array<float>"))
    return df, {"featuresCol": "vec"}


class StepRows(Hook):
    """Every global step's row ids (the labels times ``scale``, unique per row), gathered
    from all ranks and kept in the hook's state (so a resumed run forgets what its
    checkpoint forgets)."""

    def __init__(self, scale: float = 1.0):
        self.steps = {}
        self.scale = scale

    def after_train_iter(self, labels, global_step, world_size):
        import torch.distributed as dist

        mine = torch.round(labels.reshape(-1).double() * self.scale).to(torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(sizes, torch.tensor([len(mine)]))
        most = int(max(sizes))
        padded = torch.full((most,), -1, dtype=torch.int64)
        padded[:len(mine)] = mine
        gathered = [torch.empty(most, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(gathered, padded)
        self.steps[str(global_step)] = sorted(int(v) for g in gathered for v in g.tolist() if v >= 0)

    def state_dict(self):
        return {"steps": dict(self.steps)}

    def load_state_dict(self, state):
        self.steps = dict(state["steps"])


class RecordRows(Hook):
    """Saves the labels each rank trained on in each completed epoch, with the batch sizes
    and the world size, to ``<directory>/e<epoch>-w<world_size>-r<rank>.npz`` (an epoch a
    failed job did not finish leaves nothing)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._labels: list[np.ndarray] = []

    def before_train_epoch(self):
        self._labels = []

    def after_train_iter(self, labels):
        self._labels.append(labels.detach().cpu().numpy().ravel())

    def after_train_epoch(self, epoch, rank, world_size):
        labels = np.concatenate(self._labels) if self._labels else np.zeros(0)
        np.savez(os.path.join(self.directory, f"e{epoch}-w{world_size}-r{rank}.npz"), labels=labels,
                 batches=np.array([len(part) for part in self._labels]))


def recorded_rows(directory: str) -> dict[int, dict[int, dict[str, np.ndarray]]]:
    """What :class:`RecordRows` saved: ``{epoch: {world_size: {"labels": all ranks' labels
    sorted, "batches": every rank's batch sizes}}}``."""
    found: dict[int, dict[int, dict[str, list]]] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("e") and name.endswith(".npz"):
            epoch, world, _ = (int(part[1:]) for part in name[:-4].split("-"))
            saved = np.load(os.path.join(directory, name))
            entry = found.setdefault(epoch, {}).setdefault(world, {"labels": [], "batches": []})
            entry["labels"].append(saved["labels"])
            entry["batches"].append(saved["batches"])
    return {epoch: {world: {"labels": np.sort(np.concatenate(e["labels"])), "batches": np.concatenate(e["batches"])}
                    for world, e in worlds.items()} for epoch, worlds in found.items()}


def leave_group() -> None:
    """Destroys a rank process's default process group as the package's ranks do
    (``worker._teardown``): right after a collective, a plain ``destroy_process_group``
    deadlocks now and then on torch 2.3 and 2.6 (a gloo thread freeing the collective's
    tensors waits for the GIL the destroy holds while joining it)."""
    from spark_torch_est.cluster.worker import _teardown

    _teardown(clean=False)


def rank_processes():
    """A multiprocessing context for tests that start ranks as processes: forked from a server
    that has imported torch and the package once (a spawned rank imports them anew, ~2 s)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "pyarrow", "spark_torch_est", "tests.helpers"])
    return context


def end_mlflow_download_threads() -> None:
    """MLflow's artifact download leaves an idle thread pool behind until its repository
    object is collected; collect it and wait for its threads to end."""
    gc.collect()
    for thread in threading.enumerate():
        if thread.name.startswith("Mlflow"):
            thread.join(10)
