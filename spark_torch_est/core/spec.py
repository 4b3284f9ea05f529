"""[both] The plain, frozen descriptions a barrier task receives: what to train
(:class:`TaskSpec`, made by the estimator once per fit) and how to reach the driver and its
peers (:class:`Launch`, made by the launcher once per job)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from spark_torch_est.core.progress import Interval, Parent, Target
from spark_torch_est.core.schema import InputSchema

__all__ = ["TaskSpec", "Launch", "ColumnNames", "FilePart", "FileSource", "How", "KeptPlan", "StagedRows", "JOB_FIELDS",
           "placed_by"]


@dataclass(frozen=True)
class ColumnNames:
    """The user's names for the label and weight columns behind the training frame.

    Attributes:
        label: The label column.
        weight: The sample-weight column, or None without ``weightCol``.
        features: The ``featureCols`` whose values make each row's features, in order, or
            None (so messages name the column, not the whole list).
    """

    label: str = "label"
    weight: str | None = None
    features: tuple[str, ...] | None = None


@dataclass(frozen=True)
class FilePart:
    """Rows ``start`` to ``stop`` of one row group of a Parquet file.

    Attributes:
        path: The file's URL.
        row_group: The row group's index in the file.
        start: First row, within the row group.
        stop: One past the last row.
    """

    path: str
    row_group: int
    start: int
    stop: int


class How(Enum):
    """How the ranks make a training-frame column from a table's own columns (see
    :class:`FileSource`), as the Spark job would make it in the JVM."""

    AS_IS = "as_is"  #: the file's column
    WRAP = "wrap"    #: a number per row as a one-value array
    STACK = "stack"  #: numeric columns side by side as one array per row (``featureCols``)


@dataclass(frozen=True)
class FileSource:
    """A Parquet table the ranks read themselves, one part per rank.

    Attributes:
        outputs: The training frame's columns: ``(name, file columns, how)`` (a
            :class:`How`, or its value).
        parts: For each rank, the file parts it reads, in order.
        digest: A short digest of the parts and of the files as planned, to tell one split
            from another.
        files: ``(path, size, times, footer digest)`` of each file as the driver planned it
            (see :func:`~spark_torch_est.core.file_identity.file_stamp`): a rank reads a file only while it is still so.
    """

    outputs: tuple[tuple[str, tuple[str, ...], How], ...]
    parts: tuple[tuple[FilePart, ...], ...]
    digest: str
    files: tuple[tuple[str, int, str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "outputs", tuple((name, tuple(sources), How(how))
                                                  for name, sources, how in self.outputs))

    @property
    def part_rows(self) -> tuple[int, ...]:
        """The rows of each part."""
        return tuple(sum(piece.stop - piece.start for piece in part) for part in self.parts)


@dataclass(frozen=True)
class KeptPlan:
    """Rows the executors keep between fits (see :mod:`spark_torch_est.ingest.kept`).

    Attributes:
        key: What the rows were made from (the DataFrame's plan and data, see
            :mod:`spark_torch_est.ingest.kept_registry`).
        mode: ``"write"``: keep the rows the job brings; ``"read"``: the job brings none,
            the ranks take the parts they kept.
        limit: Bytes of kept rows per executor (``keepIngestedMB``).
        drop: Keys whose rows to remove (their DataFrames were unpersisted).
    """

    key: str
    mode: str
    limit: int
    drop: tuple[str, ...] = ()


@dataclass(frozen=True)
class StagedRows:
    """The training frame's rows, written by a staging job (see :mod:`spark_torch_est.ingest.staged`).

    Attributes:
        directory: The fit's folder of staged files, on the host of every executor.
        parts: ``(input partition, rows)`` of every input partition, in order.
    """

    directory: str
    parts: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TaskSpec:
    """What one fit trains; picklable, holds no Spark or torch objects.

    Attributes:
        run_id: Unique per run (kept across its fits); marks its checkpoints.
        fit_id: Unique per fit (kept across its relaunches): a relaunch resumes only from
            checkpoints this fit wrote.
        payload: cloudpickled ``Creators``.
        resume: Checkpoint bytes to continue from, or None for a fresh run.
        target: Where to stop.
        schema: The model's inputs: how each input column becomes a tensor.
        world_size: Number of ranks (barrier tasks).
        batch_size: Rows per rank per step.
        seed: Base seed for initialization, shuffles and RNG streams.
        timeout_s: Timeout for rendezvous and for every collective.
        use_gpu: True/False, or None to use a GPU when Spark assigned the task one.
        checkpoint_dir: URL for periodic checkpoints, or None.
        checkpoint_every: ``checkpointInterval``, or None for no periodic checkpoints.
        columns: The user's label and weight columns.
        memory_budget: Bytes of a partition's rows held in RAM before they spill to
            local files read per batch (None: never spill).
        allow_non_finite: Train on when the loss is NaN or infinite (``allowNonFinite``).
        fresh_hooks: Hooks added since ``resume`` was saved: they keep the state they
            were pickled with, even where ``resume`` holds one under the same name.
        source: The Parquet files the ranks read themselves, or None when the rows come
            from the Spark job's input.
        precision: The ``precision`` Param (see :mod:`spark_torch_est.train.precision`).
        compile_model: Compile each rank's model with ``torch.compile`` (``compileModel``).
        strategy: ``"ddp"`` or ``"fsdp"`` (the ``strategy`` Param, see :mod:`spark_torch_est.train.strategies.fsdp`).
        shard_modules: Class names of the submodules sharded before the root (``shardModules``),
            or None for every direct child holding parameters.
        kept: The rows kept between fits, or None (``keepIngestedMB``, see :mod:`spark_torch_est.ingest.kept`).
        staged: The training frame's rows, written beside the job by a staging job: the job's
            input is then one row per rank (see :mod:`spark_torch_est.ingest.staged`); or None.
        stop_wait_s: Seconds the driver takes at most to answer rank 0's question, at each
            epoch end, whether a driver-side logger asks the fit to stop; None when no logger
            may ask (rank 0 then never asks).
        parent: The point the run branched from, recorded in its checkpoints, or None.
        global_batch: Rows of all ranks per step when the job runs on fewer ranks than
            ``numWorkers`` (see :meth:`shrunk`); None: ``batch_size * world_size``.
        lightning: The model is a LightningModule: ``{"trainer_args": trainerArgs,
            "max_epochs": maxEpochs}`` for Lightning's Trainer; None for a plain module.
        ordered: The rows come through Spark in an order every job reproduces, in the
            training frame's logical partitions (see :mod:`spark_torch_est.ingest.canonical`);
            False: the ranks place them by hashing.
        shards: The run's logical shards, as ``resume`` records them; None for a new run
            (as many as the first job's ranks).
        together: More new runs the job trains after this one, one after another on the
            same rows and process group (a tuner's maps, see
            :mod:`spark_torch_est.together`); their fields that make the job
            (:data:`JOB_FIELDS`) equal this spec's. Rank 0 then returns their checkpoints
            packed (:func:`spark_torch_est.core.protocol.pack_runs`).
    """

    run_id: str
    fit_id: str
    payload: bytes
    resume: bytes | None
    target: Target
    schema: InputSchema
    world_size: int
    batch_size: int
    seed: int
    timeout_s: float
    use_gpu: bool | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: Interval | None = None
    columns: ColumnNames = ColumnNames()
    memory_budget: int | None = None
    allow_non_finite: bool = False
    fresh_hooks: tuple[str, ...] = ()
    source: FileSource | None = None
    precision: str = "32"
    compile_model: bool = False
    strategy: str = "ddp"
    shard_modules: tuple[str, ...] | None = None
    kept: KeptPlan | None = None
    staged: StagedRows | None = None
    stop_wait_s: float | None = None
    parent: Parent | None = None
    global_batch: int | None = None
    lightning: dict | None = None
    ordered: bool = False
    shards: int | None = None
    together: tuple[TaskSpec, ...] = ()

    @property
    def global_rows_per_step(self) -> int:
        """Rows of all ranks together per optimizer step."""
        return self.global_batch if self.global_batch is not None else self.batch_size * self.world_size

    @property
    def data_source(self) -> str:
        """Which rows each rank reads and how they are placed in the run: ``"files:"`` and
        the digest of the table's file parts (by the files' order), ``"spark:positions"``
        (through the Spark job, by the training frame's logical partitions, its rows dealt out by
        their positions) or ``"spark"`` (through the Spark job, by hashing them)."""
        if self.source is not None:
            return f"files:{self.source.digest}"
        return "spark:positions" if self.ordered else "spark"

    def shrunk(self, world_size: int, source: FileSource | None) -> TaskSpec:
        """This fit as a job of fewer ranks (``minWorkers``) with the same global batch:
        each rank takes ``batch_size * self.world_size / world_size`` rows per step
        (rounded up where that does not divide), so an epoch keeps its optimizer steps.

        Args:
            world_size: The ranks of the job.
            source: The Parquet parts of those ranks, or None when the rows come through Spark.
        """
        batch_size = -(-self.batch_size * self.world_size // world_size)
        return replace(self, world_size=world_size, batch_size=batch_size, source=source, kept=None,
                       staged=None, global_batch=self.global_rows_per_step)


#: The fields of a :class:`TaskSpec` that make its job (its ranks, the rows they read and
#: how): the runs a job trains together (``TaskSpec.together``) share them.
JOB_FIELDS = ("schema", "world_size", "timeout_s", "use_gpu", "columns", "memory_budget", "source", "kept",
              "staged", "ordered", "shards", "strategy", "lightning")


@dataclass(frozen=True)
class Launch:
    """How the tasks of one job meet: the job's id and secret, and the driver's services.

    Attributes:
        job_id: Unique per job; prefixes rendezvous keys.
        secret: The job's key: authenticates the ranks to each other, their channel to
            the driver and their failure reports.
        store_address: ``(host, port)`` of the driver's rendezvous store, or None to
            rendezvous through Spark's ``allGather``.
        channel_address: ``(host, port)`` of the driver's message channel (progress,
            logs, the checkpoint), or None.
    """

    job_id: str
    secret: bytes
    store_address: tuple[str, int] | None = None
    channel_address: tuple[str, int] | None = None


def placed_by(data_source: str) -> str:
    """How the rows of a fit that read ``data_source`` got their places in the run (see
    :mod:`spark_torch_est.ingest.canonical`): ``"files"`` (the files' order),
    ``"partitions"`` (the training frame's logical partitions), ``"round robin"`` (logical
    partitions that Spark's own round robin dealt out, ``"spark:partitions"``, in checkpoints
    written before the rows were dealt out by their positions) or ``"hash"`` (hashing: rows
    through Spark in an order no launch reproduces, or a table's files as releases before
    the files' order placed them)."""
    if data_source.startswith("files:"):
        return "files"
    return {"spark:positions": "partitions", "spark:partitions": "round robin"}.get(data_source, "hash")
