"""The plain, frozen description of one training job that the driver sends to every task."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TaskSpec", "Target"]


@dataclass(frozen=True)
class Target:
    """Where this fit stops, as absolute counters, so a relaunched job does the same work.

    Attributes:
        max_epochs: The run's ``maxEpochs``; no fit trains past it.
        epoch: Stop once this many epochs are complete (at most ``max_epochs``).
        global_step: Stop once this many optimizer steps are done, or None.
    """

    max_epochs: int
    epoch: int
    global_step: int | None = None


@dataclass(frozen=True)
class TaskSpec:
    """Everything a barrier task needs; picklable, holds no Spark or torch objects.

    Attributes:
        job_id: Unique per launch; prefixes rendezvous keys.
        run_id: Unique per run (kept across fits); marks its periodic checkpoints.
        payload: cloudpickled ``Creators``.
        resume: Checkpoint bytes to continue from, or None for a fresh run.
        target: Where to stop.
        world_size: Number of ranks (barrier tasks).
        batch_size: Rows per rank per step.
        seed: Base seed for initialization, shuffles and RNG streams.
        store_host: Host of the driver's rendezvous store, or None to rendezvous through
            Spark's ``allGather``.
        store_port: Port of that store.
        timeout_s: Timeout for rendezvous and for every collective.
        use_gpu: True/False, or None to use a GPU when Spark assigned the task one.
        checkpoint_dir: URL for periodic checkpoints, or None.
        checkpoint_every: ``(count, unit)`` from ``checkpointInterval``, e.g. ``(1, "ep")``.
        label_name: The user's label column, for messages.
        progress_address: ``(host, port)`` of the driver's progress channel, or None.
        progress_secret: The channel's per-fit secret.
        memory_budget: Bytes of a partition's rows held in RAM before they spill to
            local files read per batch (None: never spill).
    """

    job_id: str
    run_id: str
    payload: bytes
    resume: bytes | None
    target: Target
    world_size: int
    batch_size: int
    seed: int
    store_host: str | None
    store_port: int | None
    timeout_s: float
    use_gpu: bool | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: tuple[int, str] | None = None
    label_name: str = "label"
    progress_address: tuple[str, int] | None = None
    progress_secret: bytes | None = None
    memory_budget: int | None = None
