"""A rank's columns: the same rows in RAM or spilled past the budget, every dtype kept,
arrays of different lengths padded per batch."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from spark_torch_est.ingest.columns import (
    Budget,
    ColumnBuilder,
    DenseColumn,
    GrowingBuffer,
    RaggedColumn,
    SpilledColumn,
)
from spark_torch_est.ingest.tables import read_rows
from tests.helpers import features_batches, features_schema


def test_spilled_rows_are_the_same_rows_as_those_in_memory():
    in_memory = read_rows(features_batches(5000, validation_every=5), features_schema(16), memory_budget=None)
    spilled = read_rows(features_batches(5000, validation_every=5), features_schema(16), memory_budget=64 * 1024)
    features, kept = spilled.train.inputs[0], in_memory.train.inputs[0]
    assert isinstance(features, SpilledColumn) and isinstance(spilled.validation.inputs[0], SpilledColumn)
    assert isinstance(kept, DenseColumn) and len(features) == len(kept) == 4000 and len(spilled.validation) == 1000
    rows = torch.tensor([4, 3999, 17, 4])
    assert torch.equal(features.take(rows), kept.take(rows))
    assert torch.equal(features.slice(10, 20), kept.slice(10, 20))
    assert torch.equal(spilled.validation.inputs[0].slice(990, 1000), in_memory.validation.inputs[0].slice(990, 1000))
    assert torch.equal(spilled.train.labels.tensor, in_memory.train.labels.tensor)


@pytest.mark.parametrize("dtype, values", [
    (torch.uint8, np.arange(600, dtype=np.uint8).reshape(100, 6)),
    (torch.int64, (np.arange(600, dtype=np.int64) + (1 << 40)).reshape(100, 6)),
    (torch.bool, (np.arange(600) % 3 == 0).reshape(100, 6)),
])
def test_every_dtype_stays_itself_in_ram_and_in_files(dtype, values):
    for budget in (Budget(None), Budget(64)):
        builder = ColumnBuilder(dtype, budget)
        for part in np.split(values, 4):
            builder.append(part.reshape(-1), np.full(len(part), 6))
        rows = builder.finish()
        assert rows.dtype == dtype and rows.row_shape == (6,)
        assert isinstance(rows, SpilledColumn) == (budget.limit is not None)
        assert torch.equal(rows.take(torch.tensor([99, 0, 50])), torch.from_numpy(values[[99, 0, 50]]))
    if dtype == torch.uint8:  # a spill file of bytes is as big as the bytes
        assert rows._file.seek(0, 2) == values.size


def test_arrays_of_different_lengths_are_padded_to_each_batchs_longest_row():
    builder = ColumnBuilder(torch.int64, Budget(None))
    builder.append(np.arange(1, 10), np.array([2, 3, 4]))  # rows [1 2] [3 4 5] [6 7 8 9]
    rows = builder.finish(padding=-1)
    assert isinstance(rows, RaggedColumn) and len(rows) == 3
    assert rows.take(torch.tensor([0, 1])).tolist() == [[1, 2, -1], [3, 4, 5]]
    assert rows.take(torch.tensor([2, 0])).tolist() == [[6, 7, 8, 9], [1, 2, -1, -1]]
    assert rows.head(2).slice(0, 2).tolist() == [[1, 2, -1], [3, 4, 5]]
    grown = rows.extend_flat(torch.tensor([10]), torch.tensor([1]))
    assert grown.take(torch.tensor([3])).tolist() == [[10]]


def test_ragged_rows_spilled_read_the_same():
    lengths = np.array([1, 5, 2, 7, 3] * 20)
    values = np.arange(lengths.sum(), dtype=np.float32)
    kept, spilled = ColumnBuilder(torch.float32, Budget(None)), ColumnBuilder(torch.float32, Budget(16))
    for builder in (kept, spilled):
        builder.append(values, lengths)
    kept, spilled = kept.finish(padding=0.5), spilled.finish(padding=0.5)
    assert isinstance(spilled.values, SpilledColumn)
    rows = torch.tensor([3, 0, 99, 42])
    assert torch.equal(kept.take(rows), spilled.take(rows))


def test_peak_memory_of_a_partition_four_times_the_budget_stays_near_the_budget():
    """Measured in fresh processes: reading and then touching every row of a 256 MB
    partition with a 64 MB budget versus without a budget, from the peak after a first small
    read (what a process sets up once: about 30 MB with torch 2.3.1 and pyarrow 14, 10 MB
    with the newest, whatever the rows)."""
    probe = textwrap.dedent("""
        import json, sys, torch
        sys.path.insert(0, ".")
        from tests.helpers import features_batches, features_schema
        from spark_torch_est.ingest.tables import read_rows
        budget = None if sys.argv[1] == "none" else int(sys.argv[1])
        def hwm():
            return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) // 1024
        read_rows(features_batches(5000, width=128, per_batch=5000), features_schema(128))  # once a process
        base = hwm()
        ingested = read_rows(features_batches(500_000, width=128, per_batch=5000), features_schema(128),
                           memory_budget=budget)
        features = ingested.train.inputs[0]
        order = torch.randperm(len(features))
        for start in range(0, len(order), 4096):
            features.take(order[start:start + 4096]).sum()
        print(json.dumps({"growth_mb": hwm() - base, "spilled": type(features).__name__ == "SpilledColumn"}))
    """)
    results = {}
    for budget in ("none", str(64 << 20)):
        out = subprocess.run([sys.executable, "-c", probe, budget], capture_output=True, text=True, timeout=300)
        results[budget] = json.loads(out.stdout.strip().splitlines()[-1])
    in_memory, spilled = results["none"], results[str(64 << 20)]
    print("peak RSS growth, 256 MB partition:", in_memory, "vs 64 MB budget:", spilled)
    assert spilled["spilled"] and not in_memory["spilled"]
    assert in_memory["growth_mb"] > 500_000 * 128 * 4 >> 20  # the rows (244 MiB)
    assert spilled["growth_mb"] < 64 + 96            # the budget, batches in flight, allocator slack
    assert spilled["growth_mb"] < in_memory["growth_mb"] / 3


def test_rows_whose_number_is_not_known_in_advance_are_held_once():
    """Rows through Spark come without their count: a 256 MB partition, each batch made as
    it comes and dropped once copied (as the job's stream gives them), in a fresh process."""
    probe = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, ".")
        from tests.helpers import features_batches, features_schema
        from spark_torch_est.ingest.tables import read_rows
        def hwm():
            return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) // 1024
        read_rows(features_batches(5000, width=128, per_batch=5000), features_schema(128))  # once a process
        base = hwm()
        features = read_rows(features_batches(500_000, width=128, per_batch=5000), features_schema(128)).train.inputs[0]
        print(json.dumps({"growth_mb": hwm() - base, "sum": float(features.tensor[::1000].sum())}))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    print("peak RSS growth for 256 MB of rows of unknown number:", measured)
    assert measured["growth_mb"] < 256 + 48, "the rows once, a batch in flight, allocator slack: not a second copy"
    expected = sum(float(batch.column(0).flatten().to_numpy().reshape(-1, 128)[i].sum())
                   for j, batch in enumerate(features_batches(500_000, width=128, per_batch=5000))
                   for i in range(-(j * 5000) % 1000, batch.num_rows, 1000))
    assert measured["sum"] == pytest.approx(expected, rel=1e-5), "every row where it belongs"


def test_a_growing_buffer_keeps_its_rows_where_a_map_cannot_be_moved():
    """Where ``mremap`` is missing (macOS) the buffer grows by a new map and one copy."""

    class Unmovable(mmap.mmap):
        def resize(self, newsize):
            raise SystemError("mmap: resizing not available--no mremap()")

    buffer = GrowingBuffer(4, (2,), np.float32)
    del buffer.array
    buffer._map = Unmovable(-1, 4 * 2 * 4, flags=mmap.MAP_PRIVATE)
    buffer.array = buffer._view(4)
    buffer.array[:] = np.arange(8, dtype=np.float32).reshape(4, 2)
    grown = buffer.grow(9)
    assert grown.shape == (9, 2) and np.array_equal(grown[:4], np.arange(8).reshape(4, 2))
    del grown
    assert np.array_equal(buffer.grow(3, fit=True), np.arange(6).reshape(3, 2))


@pytest.mark.compat
def test_a_spilled_column_gives_no_rows_for_no_positions():
    """A shard with fewer rows than another has none in an epoch's last step (numpy before
    2.0 cannot cast a memoryview of an empty array)."""
    spilled = read_rows(features_batches(100), features_schema(16), memory_budget=1024).train.inputs[0]
    assert isinstance(spilled, SpilledColumn)
    assert spilled.take(torch.tensor([], dtype=torch.int64)).shape == (0, 16)
    assert spilled.slice(5, 5).shape == (0, 16)
    rows = torch.stack([spilled.slice(3, 4)[0], spilled.slice(1, 2)[0]])
    assert torch.equal(spilled.take(torch.tensor([3, 1])), rows)


def test_spilled_rows_can_be_cut_and_extended_in_place():
    spilled = read_rows(features_batches(2000), features_schema(16), memory_budget=16 * 1024).train.inputs[0]
    head = spilled.head(100)
    extra = torch.arange(32, dtype=torch.float32).reshape(2, 16)
    grown = head.extend(extra)
    assert len(grown) == 102 and torch.equal(grown.slice(100, 102), extra)
    assert torch.equal(grown.slice(0, 100), spilled.slice(0, 100))
    assert len(head) == 100 and len(spilled) == 2000, "extending leaves the rows it started from as they were"


def test_an_image_column_takes_a_quarter_of_the_memory_of_the_same_pixels_as_floats():
    """What a rank's ingest adds to its memory for 20,000 images of 3,072 bytes (the batches
    made beforehand), in fresh processes: a binary column (uint8 rows) against the same
    pixels as array<float>."""
    probe = textwrap.dedent("""
        import json, sys
        import numpy as np, pyarrow as pa
        sys.path.insert(0, ".")
        from spark_torch_est.ingest.tables import read_rows
        from spark_torch_est.core.protocol import LABEL, input_column
        from spark_torch_est.core.schema import INPUTS_LAYOUT, InputColumn, InputSchema
        def hwm():
            return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) // 1024
        as_bytes = sys.argv[1] == "bytes"
        column = InputColumn("image", "uint8" if as_bytes else "float32", 1, "binary" if as_bytes else "array<float>")
        rng, batches = np.random.default_rng(0), []
        for _ in range(20):
            pixels = rng.integers(0, 256, size=(1000, 3072), dtype=np.uint8)
            offsets = pa.array(np.arange(1001, dtype=np.int32) * 3072).buffers()[1]
            image = (pa.BinaryArray.from_buffers(pa.binary(), 1000, [None, offsets, pa.py_buffer(pixels.tobytes())])
                     if as_bytes else
                     pa.FixedSizeListArray.from_arrays(pa.array(pixels.reshape(-1).astype(np.float32)), 3072))
            batches.append(pa.RecordBatch.from_arrays([image, pa.array(np.zeros(1000))], [input_column(0), LABEL]))
        base = hwm()
        ingested = read_rows(iter(batches), InputSchema(INPUTS_LAYOUT, (column,)))
        print(json.dumps({"growth_mb": hwm() - base, "dtype": str(ingested.train.inputs[0].dtype)}))
    """)
    results = {}
    for kind in ("bytes", "floats"):
        out = subprocess.run([sys.executable, "-c", probe, kind], capture_output=True, text=True, timeout=300)
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    print("memory a rank's ingest adds for 20,000 images:", results)
    assert results["bytes"]["dtype"] == "torch.uint8" and results["floats"]["dtype"] == "torch.float32"
    assert results["bytes"]["growth_mb"] < 61 + 20                   # the 61 MB of pixels, once
    assert results["floats"]["growth_mb"] > 3 * results["bytes"]["growth_mb"]
