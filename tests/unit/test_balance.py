"""Evening out the ranks' rows: the plan, and the moves over a real two-rank gloo group."""

from __future__ import annotations

import multiprocessing
import random

import pytest

from spark_torch_est.ingest.balance import transfer_plan


@pytest.mark.parametrize("seed", range(20))
def test_a_plan_evens_counts_to_within_one_row_and_each_rank_only_sends_or_receives(seed):
    generator = random.Random(seed)
    counts = [generator.randint(0, 50) for _ in range(generator.randint(1, 6))]
    after = list(counts)
    for source, destination, rows in transfer_plan(counts):
        assert rows > 0
        after[source] -= rows
        after[destination] += rows
    assert sum(after) == sum(counts) and max(after) - min(after) <= 1
    senders = {s for s, _, _ in transfer_plan(counts)}
    receivers = {d for _, d, _ in transfer_plan(counts)}
    assert not senders & receivers


def _rank(rank: int, store_path: str, spill: bool, results) -> None:
    from datetime import timedelta

    import numpy as np
    import torch
    import torch.distributed as dist

    from spark_torch_est.ingest.balance import rebalance, transfer_plan
    from spark_torch_est.ingest.rows import Budget, DenseRows, RowsBuilder
    from spark_torch_est.ingest.shard import Table

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    try:
        counts = [10, 2]
        features = RowsBuilder(torch.float32, Budget(0 if spill and rank == 1 else None))  # spilled: into its file
        features.append(np.arange(counts[rank] * 3, dtype=np.float32) + 100 * rank, np.full(counts[rank], 3))
        tokens = RowsBuilder(torch.int64, Budget(None))  # arrays of different lengths move as lengths and values
        lengths = np.arange(counts[rank]) % 3 + 1
        tokens.append(np.arange(lengths.sum()) + 1000 * rank, lengths)
        labels = DenseRows(torch.arange(counts[rank], dtype=torch.int64) + 100 * rank)
        table = Table([features.finish(), tokens.finish(padding=-1)], labels)
        table = rebalance(table, transfer_plan(counts), rank, device=torch.device("cpu"))
        results.put((rank, table.inputs[0].slice(0, len(table)).tolist(), table.labels.tensor.tolist(),
                     table.inputs[1].slice(0, len(table)).tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("spill", [False, True])
def test_rows_move_from_the_larger_rank_to_the_smaller_one(tmp_path, spill):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank, args=(r, str(tmp_path / "store"), spill, results)) for r in range(2)]
    for process in processes:
        process.start()
    outcome = {rank: rest for rank, *rest in (results.get(timeout=60) for _ in processes)}
    for process in processes:
        process.join(30)
    assert outcome[0][1] == list(range(6))                          # rank 0 keeps its first rows
    assert outcome[1][1] == [100, 101, 6, 7, 8, 9]                  # rank 1: its own, then rank 0's last
    assert outcome[1][0][2] == [18.0, 19.0, 20.0]                   # features travel with their labels
    assert outcome[1][2][0][:1] == [1000] and outcome[1][2][2] == [12, -1, -1]  # so do ragged tokens
