"""Evening out the ranks' rows: the plan, and the moves over a real two-rank gloo group."""

from __future__ import annotations

import multiprocessing
import random

import pytest

from spark_torch_est.balance import transfer_plan


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
    import tempfile
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from spark_torch_est.balance import rebalance, transfer_plan
    from spark_torch_est.rowstore import SpilledRows

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    try:
        counts = [10, 2]
        features = torch.arange(counts[rank] * 3, dtype=torch.float32).reshape(-1, 3) + 100 * rank
        labels = torch.arange(counts[rank], dtype=torch.int64) + 100 * rank
        if spill and rank == 1:  # a spilled rank receives rows into its file
            rows = SpilledRows(tempfile.TemporaryFile(), 0, 3)
            features = rows.extend(features)
        features, labels = rebalance(features, labels, transfer_plan(counts), rank, feature_shape=(3,),
                                     label_shape=(), label_dtype=torch.int64, device=torch.device("cpu"))
        results.put((rank, features[0:len(features)].tolist(), labels.tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("spill", [False, True])
def test_rows_move_from_the_larger_rank_to_the_smaller_one(tmp_path, spill):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank, args=(r, str(tmp_path / "store"), spill, results)) for r in range(2)]
    for process in processes:
        process.start()
    outcome = {rank: (features, labels) for rank, features, labels in (results.get(timeout=60) for _ in processes)}
    for process in processes:
        process.join(30)
    assert outcome[0][1] == list(range(6))                          # rank 0 keeps its first rows
    assert outcome[1][1] == [100, 101, 6, 7, 8, 9]                  # rank 1: its own, then rank 0's last
    assert outcome[1][0][2] == [18.0, 19.0, 20.0]                   # features travel with their labels
