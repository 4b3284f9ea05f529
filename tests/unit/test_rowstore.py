"""Partitions past the memory budget spill to local files read back per batch, with the same rows."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import torch

from spark_torch_est.data import read_shard
from spark_torch_est.protocol import FEATURES, IS_VALIDATION, LABEL
from spark_torch_est.rowstore import SpilledRows


def _batches(rows: int, width: int = 16, per_batch: int = 1000, seed: int = 0):
    rng = np.random.default_rng(seed)
    for start in range(0, rows, per_batch):
        n = min(per_batch, rows - start)
        x = rng.normal(size=(n, width)).astype(np.float32)
        yield pa.RecordBatch.from_arrays(
            [pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), width), pa.array(x.sum(axis=1)),
             pa.array(np.arange(start, start + n) % 5 == 0)],
            [FEATURES, LABEL, IS_VALIDATION])


def test_a_spilled_shard_holds_the_same_rows_as_an_in_memory_one():
    in_memory = read_shard(_batches(5000), memory_budget=None)
    spilled = read_shard(_batches(5000), memory_budget=64 * 1024)
    assert isinstance(spilled.features, SpilledRows) and isinstance(spilled.val_features, SpilledRows)
    assert isinstance(in_memory.features, torch.Tensor)
    assert spilled.features.shape == in_memory.features.shape and len(spilled.val_features) == 1000
    rows = torch.tensor([4, 3999, 17, 4])
    assert torch.equal(spilled.features[rows], in_memory.features[rows])
    assert torch.equal(spilled.features[10:20], in_memory.features[10:20])
    assert torch.equal(spilled.val_features[990:1000], in_memory.val_features[990:])
    for name in ("labels", "val_labels"):
        assert torch.equal(getattr(spilled, name), getattr(in_memory, name)), name


def test_peak_memory_of_a_partition_four_times_the_budget_stays_near_the_budget():
    """Measured in fresh processes: reading and then touching every row of a 256 MB
    partition with a 64 MB budget versus without a budget."""
    probe = textwrap.dedent("""
        import json, sys, torch
        sys.path.insert(0, ".")
        from tests.unit.test_rowstore import _batches
        from spark_torch_est.data import read_shard
        budget = None if sys.argv[1] == "none" else int(sys.argv[1])
        def hwm():
            return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) // 1024
        base = hwm()
        shard = read_shard(_batches(500_000, width=128, per_batch=5000), memory_budget=budget)
        order = torch.randperm(len(shard.features))
        for start in range(0, len(order), 4096):
            shard.features[order[start:start + 4096]].sum()
        print(json.dumps({"growth_mb": hwm() - base, "spilled": not isinstance(shard.features, torch.Tensor)}))
    """)
    results = {}
    for budget in ("none", str(64 << 20)):
        out = subprocess.run([sys.executable, "-c", probe, budget], capture_output=True, text=True, timeout=300)
        results[budget] = json.loads(out.stdout.strip().splitlines()[-1])
    in_memory, spilled = results["none"], results[str(64 << 20)]
    print("peak RSS growth, 256 MB partition:", in_memory, "vs 64 MB budget:", spilled)
    assert spilled["spilled"] and not in_memory["spilled"]
    assert in_memory["growth_mb"] > 256              # the rows (plus a concatenation copy)
    assert spilled["growth_mb"] < 64 + 96            # the budget, batches in flight, allocator slack
    assert spilled["growth_mb"] < in_memory["growth_mb"] / 3


def test_spilled_rows_can_be_cut_and_extended_in_place():
    spilled = read_shard(_batches(2000), memory_budget=16 * 1024).features
    head = spilled.head(100)
    extra = torch.arange(32, dtype=torch.float32).reshape(2, 16)
    head.extend(extra)
    assert len(head) == 102 and torch.equal(head[100:102], extra)
    assert torch.equal(head[0:100], spilled[0:100])
