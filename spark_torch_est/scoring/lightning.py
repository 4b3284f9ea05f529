"""[executor] ``TorchModel.evaluate`` of a LightningModule: Lightning's own ``Trainer.validate``
runs the module's ``validation_step`` over a partition's rows on the task's device, batches
as in training (:func:`spark_torch_est.train.lightning.step_batch`); the driver weighs each
partition's values by its rows (:func:`validated`), as the Trainer weighs each batch's.
"""

from __future__ import annotations

import importlib
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

from spark_torch_est.core.worker_gc import freeze_older
from spark_torch_est.errors import InvalidInputError
from spark_torch_est.scoring.inference import ScoringSpec, load_model, model_device, read_inputs, read_targets
from spark_torch_est.train.lightning import namespace_of, step_batch, trainer_args

__all__ = ["VALIDATION_SCHEMA", "validate_task", "validated"]

#: One row per partition: its rows and what ``Trainer.validate`` returned for them.
VALIDATION_SCHEMA = "rows long, names array<string>, values array<double>"


class _Batches:
    """A partition's rows as the module's validation batches, read as the Trainer asks for
    them (one pass, ``spec.batch_size`` rows a batch); counts the rows it gave."""

    def __init__(self, batches: Iterator[pa.RecordBatch], spec: ScoringSpec) -> None:
        self.batches, self.spec, self.rows = batches, spec, 0

    def __iter__(self) -> Iterator[tuple]:
        spec, schema = self.spec, self.spec.input_schema
        for batch in self.batches:
            inputs = read_inputs([batch.column(name) for name in spec.columns], spec)
            labels, weights = read_targets(batch, spec)
            for start in range(0, len(labels), spec.batch_size):
                stop = min(start + spec.batch_size, len(labels))
                self.rows += stop - start
                yield step_batch(schema.model_inputs([x.slice(start, stop) for x in inputs]), labels[start:stop],
                                 weights[start:stop] if weights is not None else None)


def validate_task(spec: ScoringSpec) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Returns the ``mapInArrow`` function that validates a partition's rows."""

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        freeze_older()
        module = load_model(spec)
        namespace = namespace_of(module)
        if namespace is None:  # the driver saw a LightningModule's run
            raise InvalidInputError(f"the model creator returned {type(module).__name__}, not a LightningModule")
        device = model_device(module)
        trainer = importlib.import_module(namespace).Trainer(
            **trainer_args(namespace, device, spec.precision), logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tempfile.gettempdir())
        rows = _Batches(batches, spec)
        try:
            (values,) = trainer.validate(module, dataloaders=rows, verbose=False)
        finally:  # the module stays cached for later tasks as it was: without this Trainer, on its device
            module.trainer = None  # type: ignore[assignment]
            module.to(device).eval()  # the Trainer's teardown moved it to the CPU
        yield pa.RecordBatch.from_pydict(
            {"rows": [rows.rows], "names": [list(values)], "values": [[float(v) for v in values.values()]]},
            schema=pa.schema([("rows", pa.int64()), ("names", pa.list_(pa.string())),
                              ("values", pa.list_(pa.float64()))]))

    return task


def validated(partitions: list[Any]) -> dict[str, float]:
    """The values ``Trainer.validate`` returns for every row: each partition's, weighed by its
    rows (exact for what ``validation_step`` logs with Lightning's default mean).

    Raises:
        InvalidInputError: No partition had a row.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for partition in partitions:
        if not partition["rows"]:  # what an epoch end logged over no rows (a metric's NaN) is no value
            continue
        for name, value in zip(partition["names"], partition["values"]):
            sums[name] = sums.get(name, 0.0) + value * partition["rows"]
            counts[name] = counts.get(name, 0) + partition["rows"]
    if not any(partition["rows"] for partition in partitions):
        raise InvalidInputError("evaluate() got a DataFrame without rows")
    return {name: sums[name] / counts[name] for name in sums}
