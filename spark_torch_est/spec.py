"""[both] The plain, frozen descriptions a barrier task receives: what to train
(:class:`TaskSpec`, made by the estimator once per fit) and how to reach the driver and its
peers (:class:`Launch`, made by the launcher once per job)."""

from __future__ import annotations

from dataclasses import dataclass

from spark_torch_est.progress import Target

__all__ = ["TaskSpec", "Launch", "Columns"]


@dataclass(frozen=True)
class Columns:
    """The user's names for the columns behind the training frame, for messages.

    Attributes:
        features: The features column (or the featureCols joined by commas).
        label: The label column.
    """

    features: str = "features"
    label: str = "label"


@dataclass(frozen=True)
class TaskSpec:
    """What one fit trains; picklable, holds no Spark or torch objects.

    Attributes:
        run_id: Unique per run (kept across its fits); marks its checkpoints.
        payload: cloudpickled ``Creators``.
        resume: Checkpoint bytes to continue from, or None for a fresh run.
        target: Where to stop.
        world_size: Number of ranks (barrier tasks).
        batch_size: Rows per rank per step.
        seed: Base seed for initialization, shuffles and RNG streams.
        timeout_s: Timeout for rendezvous and for every collective.
        use_gpu: True/False, or None to use a GPU when Spark assigned the task one.
        checkpoint_dir: URL for periodic checkpoints, or None.
        checkpoint_every: ``(count, unit)`` from ``checkpointInterval``, e.g. ``(1, "ep")``.
        columns: The user's column names, for messages.
        memory_budget: Bytes of a partition's rows held in RAM before they spill to
            local files read per batch (None: never spill).
        allow_non_finite: Train on when the loss is NaN or infinite (``allowNonFinite``).
        fresh_hooks: Hooks added since ``resume`` was saved: they keep the state they
            were pickled with, even where ``resume`` holds one under the same name.
    """

    run_id: str
    payload: bytes
    resume: bytes | None
    target: Target
    world_size: int
    batch_size: int
    seed: int
    timeout_s: float
    use_gpu: bool | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: tuple[int, str] | None = None
    columns: Columns = Columns()
    memory_budget: int | None = None
    allow_non_finite: bool = False
    fresh_hooks: tuple[str, ...] = ()


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
