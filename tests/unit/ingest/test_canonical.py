"""One epoch order on any number of ranks: real ranks (gloo, one process each) train the
real loop, and a hook gathers every step's row ids across them; the epoch plan's steps."""

from __future__ import annotations

import functools
import os

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spark_torch_est import Checkpoint
from spark_torch_est.cluster.barrier import LocalBarrier
from spark_torch_est.core.progress import Target
from spark_torch_est.core.protocol import FEATURES, IS_VALIDATION, LABEL, ROW_ID
from spark_torch_est.core.spec import How, Launch
from spark_torch_est.ingest import parquet_plan
from spark_torch_est.ingest.canonical import PARTITION_SHIFT, EpochPlan, epoch_order, row_keys
from spark_torch_est.ingest.columns import DenseColumn
from spark_torch_est.ingest.tables import Table
from spark_torch_est.train.creators import Creators
from spark_torch_est.train.hooks import normalize_hooks
from tests.helpers import SeenRows, StepRows, leave_group, mlp, rank_processes, sgd, task_spec

ROWS = 240


def _batches(rows: np.ndarray, total: int = ROWS) -> list[pa.RecordBatch]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(total, 8)).astype(np.float32)[rows]
    features = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 8)
    return [pa.RecordBatch.from_arrays([features, pa.array(rows.astype(np.int64))], [FEATURES, LABEL])]


class _FileBarrier(LocalBarrier):
    """A lone rank's barrier whose all_gather goes through a file store, for ranks started as processes."""

    def __init__(self, rank: int, world_size: int, path: str):
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        self._store = dist.FileStore(path, world_size)

    def all_gather(self, message: str) -> list[str]:
        self._store.set(str(self.rank), message)
        return [self._store.get(str(r)).decode() for r in range(self.world_size)]


def _partition_batches(rank: int, world: int, bounds: tuple[int, int, int]) -> list[pa.RecordBatch]:
    """What the training frame of a run of two logical partitions (rows ``bounds[0]`` to
    ``bounds[1] - 1`` and on to ``bounds[2] - 1``) gives a rank: on two ranks partition
    ``rank`` whole, in order; on others the rows dealt anew, each with its place in its
    partition (ROW_ID). Every tenth row is a validation row."""
    if world == 2:
        rows = np.arange(bounds[rank], bounds[rank + 1])
    else:
        rows = np.random.default_rng(world).permutation(bounds[2])[rank::world]
    (batch,) = _batches(rows, bounds[2])
    columns = [batch.column(0), batch.column(1), pa.array(rows % 10 == 9)]
    names = [FEATURES, LABEL, IS_VALIDATION]
    if world != 2:
        partition = (rows >= bounds[1]).astype(np.int64)
        columns.append(pa.array((partition << PARTITION_SHIFT) | (rows - np.array(bounds)[partition])))
        names.append(ROW_ID)
    return [pa.RecordBatch.from_arrays(columns, names)]


def _rank(rank, world, directory, spec, results, total=ROWS, partitions=None):
    from spark_torch_est.cluster.worker import run_rank

    torch.set_num_threads(1)
    if partitions is not None:
        batches = _partition_batches(rank, world, partitions)
    else:
        rows = np.random.default_rng(world).permutation(total)[rank::world]  # each world size deals rows anew
        batches = _batches(np.sort(rows), total)
    launch = Launch(job_id=f"job{world}", secret=b"s" * 32)
    barrier = _FileBarrier(rank, world, directory + "/barrier")
    blob = run_rank(spec, launch, iter(batches), barrier)
    if blob is not None:
        results.put(blob)


def _run(tmp_path, world: int, target: Target, resume: bytes | None = None, total: int = ROWS,
         table: str | None = None, hooks: dict | None = None, partitions: tuple[int, int, int] | None = None,
         **fields) -> Checkpoint:
    """Trains on ``world`` ranks (a global batch of 12 rows) on ``total`` rows to ``target``
    (the ranks reading their parts of the Parquet file ``table`` themselves, if given; or
    through Spark in two logical partitions of rows ``partitions[0]`` to ``partitions[1] - 1``
    and on, see :func:`_partition_batches`); the checkpoint."""
    if partitions is not None:
        fields["ordered"] = True
    directory = tmp_path / f"w{world}-{os.urandom(4).hex()}"
    directory.mkdir()
    if table is not None:
        fields["source"] = parquet_plan._split([table], _TABLE_OUTPUTS, world, larger_first=True)
    spec = task_spec(target, hooks=hooks or {"rows": StepRows()}, world_size=world, batch_size=12 // world,
                     resume=resume, **fields)
    context = rank_processes()
    results = context.Queue()
    processes = [context.Process(target=_rank, args=(r, world, str(directory), spec, results, total, partitions))
                 for r in range(world)]
    for process in processes:
        process.start()
    blob = results.get(timeout=120)
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    return Checkpoint.from_bytes(blob)


def _weights(checkpoint: Checkpoint) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in checkpoint.model_state.values()])


def test_a_run_continued_mid_epoch_on_one_then_three_ranks_trains_the_steps_of_an_undisturbed_run(tmp_path):
    whole = _run(tmp_path, 2, Target(epoch=2))                              # 20 steps of 12 rows per epoch
    part = _run(tmp_path, 2, Target(epoch=2, global_step=7))
    shrunk = _run(tmp_path, 1, Target(epoch=2, global_step=15), resume=part.to_bytes())
    grown = _run(tmp_path, 3, Target(epoch=2), resume=shrunk.to_bytes())
    steps = whole.hook_states["rows"]["steps"]
    assert sorted(map(int, steps)) == list(range(1, 41))
    assert grown.hook_states["rows"]["steps"] == steps, "each global step trains the rows it trains undisturbed"
    for epoch in (0, 1):
        seen = sorted(v for s in range(20 * epoch + 1, 20 * epoch + 21) for v in steps[str(s)])
        assert seen == list(range(ROWS)), "every row exactly once per epoch"
    assert grown.progress == whole.progress and grown.shards == 2


def test_a_run_resumed_mid_epoch_on_as_many_ranks_is_bitwise_the_undisturbed_one(tmp_path):
    whole = _run(tmp_path, 2, Target(epoch=2))
    part = _run(tmp_path, 2, Target(epoch=2, global_step=13))
    resumed = _run(tmp_path, 2, Target(epoch=2), resume=part.to_bytes())
    assert torch.equal(_weights(resumed), _weights(whole))
    assert resumed.hook_states["rows"]["steps"] == whole.hook_states["rows"]["steps"]


def test_rows_that_do_not_fill_the_last_step_train_once_each_epoch_on_any_number_of_ranks(tmp_path):
    # 97 rows in 2 logical shards (49 and 48) at 12 rows a step: 9 steps, the last one of 1
    # row, which the second rank has none of. The last step is short, not padded with repeats.
    creators = Creators(model=mlp, optimizer=sgd, loss=torch.nn.MSELoss(), hooks=normalize_hooks({"rows": StepRows()}),
                        config={"lr": 1e-5})
    run = functools.partial(_run, tmp_path, total=97, payload=cloudpickle.dumps(creators))
    whole = run(2, Target(epoch=2))
    part = run(2, Target(epoch=2, global_step=4))
    shrunk = run(1, Target(epoch=2, global_step=13), resume=part.to_bytes())
    grown = run(3, Target(epoch=2), resume=shrunk.to_bytes())
    steps = whole.hook_states["rows"]["steps"]
    assert sorted(map(int, steps)) == list(range(1, 19))
    for epoch in (0, 1):
        seen = sorted(v for s in range(9 * epoch + 1, 9 * epoch + 10) for v in steps[str(s)])
        assert seen == list(range(97)), "every row exactly once per epoch"
    assert [len(steps[str(s)]) for s in (9, 18)] == [1, 1], "the last step is short"
    assert grown.hook_states["rows"]["steps"] == steps, "each global step trains the rows it trains undisturbed"
    assert grown.progress == whole.progress
    # each step's gradient is the mean over its rows, however the ranks split them
    torch.testing.assert_close(_weights(grown), _weights(whole), rtol=1e-5, atol=1e-6)


_TABLE_OUTPUTS = ((FEATURES, ("x",), How.AS_IS), (LABEL, ("id",), How.AS_IS))


def _table(tmp_path, total: int) -> str:
    """A Parquet file of ``total`` rows (features ``x``, label ``id`` = the row's place), in row groups of 20."""
    (batch,) = _batches(np.arange(total), total)
    path = str(tmp_path / "table.parquet")
    pq.write_table(pa.table({"x": batch.column(0), "id": batch.column(1)}), path, row_group_size=20)
    return path


def test_a_table_read_in_its_files_order_keeps_each_part_on_its_rank_and_continues_on_any_number(tmp_path):
    # 101 rows read from the files on 2 ranks: parts of 51 and 50 rows, the run's two logical
    # shards as read, so each rank trains the rows it read (none is hashed or moved).
    table, seen = _table(tmp_path, 101), tmp_path / "seen"
    seen.mkdir()
    run = functools.partial(_run, tmp_path, total=101, table=table)
    whole = run(2, Target(epoch=2), hooks={"rows": StepRows(), "seen": SeenRows(str(seen))})
    for rank, part in ((0, range(51)), (1, range(51, 101))):
        for epoch in (0, 1):
            assert sorted(int(v) for path in seen.glob(f"epoch{epoch}-rank{rank}-*")
                          for v in path.read_text().split()) == list(part)
    part = run(2, Target(epoch=2, global_step=4))
    grown = run(3, Target(epoch=2, global_step=13), resume=part.to_bytes())
    shrunk = run(1, Target(epoch=2), resume=grown.to_bytes())
    steps = whole.hook_states["rows"]["steps"]
    assert shrunk.hook_states["rows"]["steps"] == steps, "each global step trains the rows it trains undisturbed"
    for epoch in (0, 1):
        assert sorted(v for s in range(9 * epoch + 1, 9 * epoch + 10) for v in steps[str(s)]) == list(range(101))


@pytest.mark.parametrize("middle", [130, 200])
def test_rows_through_spark_in_logical_partitions_stay_put_and_continue_on_any_number_of_ranks(middle, tmp_path):
    # Two logical partitions (every tenth row validates): rows 0-129 and 130-239 hold 117 and
    # 99 training rows, even enough to be the run's shards as they are: on two ranks each
    # trains its own partition's rows, 6 a step, so the epoch's last steps take the longer
    # one's rows alone (20 steps). Rows 0-199 and 200-239 (180 and 36) are evened out into
    # two shards of 108 (18 steps). Continued mid-epoch on one, then three ranks (rows dealt
    # anew, each carrying its place), every global step trains the rows it trains
    # undisturbed; resumed on two, bitwise the undisturbed run.
    seen = tmp_path / "seen"
    seen.mkdir()
    run = functools.partial(_run, tmp_path, partitions=(0, middle, ROWS))
    whole = run(2, Target(epoch=2), hooks={"rows": StepRows(), "seen": SeenRows(str(seen))})
    training = [v for v in range(ROWS) if v % 10 != 9]
    first = training.index(middle) if middle == 130 else len(training) // 2
    epoch_steps = 20 if middle == 130 else 18
    for rank, shard in ((0, training[:first]), (1, training[first:])):
        for epoch in (0, 1):
            assert sorted(int(v) for path in seen.glob(f"epoch{epoch}-rank{rank}-*")
                          for v in path.read_text().split()) == shard, "each rank trains its shard"
    steps = whole.hook_states["rows"]["steps"]
    assert sorted(map(int, steps)) == list(range(1, 2 * epoch_steps + 1))
    for epoch in (0, 1):
        assert sorted(v for s in range(epoch_steps * epoch + 1, epoch_steps * (epoch + 1) + 1)
                      for v in steps[str(s)]) == training, "every training row exactly once per epoch"
    if middle == 130:
        assert [len(steps[str(s)]) for s in (16, 17, 18, 20)] == [12, 9, 6, 3]
    part = run(2, Target(epoch=2, global_step=7))
    shrunk = run(1, Target(epoch=2, global_step=epoch_steps + 6), resume=part.to_bytes())
    grown = run(3, Target(epoch=2), resume=shrunk.to_bytes())
    assert grown.hook_states["rows"]["steps"] == steps, "each global step trains the rows it trains undisturbed"
    assert grown.progress == whole.progress and grown.shards == 2 and grown.data_source == "spark:positions"
    resumed = run(2, Target(epoch=2), resume=run(2, Target(epoch=2, global_step=epoch_steps - 2)).to_bytes())
    assert torch.equal(_weights(resumed), _weights(whole))


def test_a_row_key_depends_on_the_values_only():
    x = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    table = Table([DenseColumn(x)], DenseColumn(torch.arange(6)))
    keys = row_keys(table)
    assert len(set(keys.tolist())) == 6
    reversed_table = Table([DenseColumn(x.flip(0))], DenseColumn(torch.arange(6).flip(0)))
    assert torch.equal(row_keys(reversed_table), keys.flip(0))
    ragged = Table([DenseColumn(x).to_ragged(0.0)], DenseColumn(torch.arange(6)))
    assert torch.equal(row_keys(ragged), keys), "the same values however the column holds them"


@pytest.mark.parametrize("seed", range(3))
def test_equal_rows_have_equal_keys_and_others_differ(seed):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.integers(0, 3, size=(500, 3)).astype(np.float32))
    keys = row_keys(Table([DenseColumn(x)], DenseColumn(torch.zeros(500))))
    distinct_rows = len({tuple(r) for r in x.tolist()})
    assert len(set(keys.tolist())) == distinct_rows


@pytest.mark.parametrize("budget", [None, 64])
def test_the_layout_keeps_every_row_whole_whatever_its_columns_hold(budget, tmp_path, monkeypatch):
    from spark_torch_est.core.ranks import Ranks
    from spark_torch_est.ingest.canonical import to_canonical
    from spark_torch_est.ingest.columns import RaggedColumn

    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path))  # where rows past the budget spill
    lengths = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    ragged = RaggedColumn(DenseColumn(torch.arange(int(lengths.sum()), dtype=torch.float32)), offsets, -1.0)
    dense = DenseColumn(torch.arange(16, dtype=torch.int64).reshape(8, 2))
    table = Table([ragged, dense], DenseColumn(torch.arange(8, dtype=torch.float32)))
    canonical = to_canonical(table, [8], 1, 4, 0, Ranks(0, 1, torch.device("cpu")), budget)
    laid, slots = canonical.table, canonical.slots.long()  # the row of each position in the logical shard
    ids = laid.labels.take(slots).long()
    assert sorted(ids.tolist()) == list(range(8)) and ids.tolist() != list(range(8))
    assert torch.equal(laid.inputs[1].take(slots), dense.tensor[ids])
    assert torch.equal(laid.inputs[0].take(slots), ragged.take(ids))


def _layout_inputs(world: int) -> tuple[list[torch.Tensor], list[Table]]:
    """Every rank's keys (repeated keys within and across ranks, uneven counts, keys at both
    ends of the range) and table (rows numbered by their label: ragged values in RAM and
    spilled, dense and spilled rows of one shape)."""
    from spark_torch_est.ingest.columns import Budget, ColumnBuilder

    rng = np.random.default_rng(7)
    counts = [5 + 7 * r for r in range(world)]
    ends = [-(2 ** 63), 2 ** 63 - 1, 0]
    keys = [torch.from_numpy(rng.choice(np.concatenate([rng.integers(-2 ** 63, 2 ** 63 - 1, 6), ends]), n))
            for n in counts]
    tables, first = [], 0
    for n in counts:
        labels = np.arange(first, first + n)
        lengths = (labels * 7) % 5
        values = np.concatenate([np.full(k, g, dtype=np.float32) for g, k in zip(labels, lengths)])
        ragged, ragged_spilled = ColumnBuilder(torch.float32), ColumnBuilder(torch.float32, Budget(0))
        ragged.append(values, lengths)
        ragged_spilled.append(values, lengths)
        dense = np.stack([labels, -labels]).T.astype(np.int64)
        spilled = ColumnBuilder(torch.int64, Budget(0))
        spilled.append(dense.ravel(), np.full(n, 2))
        inputs = [ragged.finish_column(-1.0), ragged_spilled.finish_column(-1.0), DenseColumn(torch.from_numpy(dense)),
                  spilled.finish_column()]
        tables.append(Table(inputs, DenseColumn(torch.from_numpy(labels.astype(np.float32)))))
        first += n
    return keys, tables


def _layout_rank(rank: int, world: int, path: str, results) -> None:
    import torch.distributed as dist

    from spark_torch_est.core.ranks import Ranks
    from spark_torch_est.ingest.canonical import move_rows, run_ids

    torch.set_num_threads(1)
    os.environ["SPARK_LOCAL_DIRS"] = os.path.dirname(path)
    dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world)
    try:
        ranks = Ranks(rank, world, torch.device("cpu"))
        keys, tables = _layout_inputs(world)
        ids = run_ids(keys[rank], ranks)
        total = sum(len(t) for t in tables)
        destination = torch.from_numpy(np.random.default_rng(3).permutation(total))  # row g goes to place [g]
        mine = destination[tables[rank].labels.tensor.long()]
        laid = move_rows(tables[rank], mine % world, mine // world, len(range(rank, total, world)), ranks, 10_000)
        rows = torch.arange(len(laid))
        results.put((rank, ids.tolist(), [c.take(rows).tolist() for c in laid.columns()],
                     [type(c).__name__ + type(getattr(c, "values", c)).__name__ for c in laid.columns()]))
    finally:
        leave_group()


def test_three_ranks_place_and_move_rows_as_one_sort_of_all_rows_would(tmp_path):
    """The run's order, sorted across three ranks, is one stable sort of every rank's keys in
    rank order; rows reach their places whole from every kind of column, spilled ones stay
    on disk (those in RAM stay there within the budget)."""
    world = 3
    context = rank_processes()
    results = context.Queue()
    processes = [context.Process(target=_layout_rank, args=(r, world, str(tmp_path / "store"), results))
                 for r in range(world)]
    for process in processes:
        process.start()
    got = dict((rank, rest) for rank, *rest in (results.get(timeout=120) for _ in range(world)))
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    keys, tables = _layout_inputs(world)
    expected = torch.empty(sum(map(len, keys)), dtype=torch.int64)
    expected[torch.sort(torch.cat(keys), stable=True).indices] = torch.arange(len(expected))
    assert torch.cat([torch.tensor(got[r][0]) for r in range(world)]).tolist() == expected.tolist()
    destination = np.random.default_rng(3).permutation(len(expected))
    for rank in range(world):
        rows = torch.from_numpy(np.argsort(destination)[rank::world])  # the rows that land on this rank, in place order
        ragged, ragged_spilled, dense, spilled, labels = got[rank][1]
        assert labels == rows.float().tolist()
        assert dense == spilled == torch.stack([rows, -rows], 1).tolist()
        lengths = (rows * 7) % 5
        padded = [[float(g)] * int(k) + [-1.0] * (int(lengths.max()) - int(k)) for g, k in zip(rows, lengths)]
        assert ragged == ragged_spilled == padded
        assert got[rank][2][1] == "RaggedColumnSpilledColumn" and got[rank][2][3] == "SpilledColumnSpilledColumn"
        assert got[rank][2][2] == "DenseColumnDenseColumn"


def _streaming_rank(rank: int, world: int, path: str, streamed: bool, results) -> None:
    """Moves 300,000 rows x 64 float32 of this rank (77 MB, filled with each row's number)
    to places drawn at random, streamed or into their places, measuring the peak RSS it adds."""
    import torch.distributed as dist

    from spark_torch_est.core.ranks import Ranks
    from spark_torch_est.ingest.canonical import move_rows, stream_rows

    def status(field: str) -> int:
        return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) // 1024

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world)
    try:
        ranks, rows = Ranks(rank, world, torch.device("cpu")), 300_000
        numbers = torch.arange(rank * rows, (rank + 1) * rows)
        table = Table([DenseColumn(numbers.float().unsqueeze(1).repeat(1, 64))], DenseColumn(numbers.float()))
        destination = torch.from_numpy(np.random.default_rng(5).permutation(rows * world))  # row g goes to place [g]
        mine = destination[numbers]
        size = len(range(rank, rows * world, world))
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # the peak starts again from here
        before = status("VmRSS")
        if streamed:
            moved, positions, carry = stream_rows(table, mine % world, mine // world, size, ranks, None)
            ids = carry(numbers)
        else:
            moved, positions = move_rows(table, mine % world, mine // world, size, ranks, None), torch.arange(size)
            ids = None
        growth = status("VmHWM") - before
        expected = torch.argsort(destination)[positions * world + rank]  # the row for each place
        inputs = moved.inputs[0].tensor
        right = bool((inputs == expected.float().unsqueeze(1)).all()) and torch.equal(moved.labels.tensor,
                                                                                    expected.float())
        right = right and (ids is None or torch.equal(ids, expected))
        results.put((rank, growth, right, sorted(positions.tolist()) == list(range(size))))
    finally:
        leave_group()


def test_rows_streamed_to_other_ranks_hold_the_old_and_new_rows_together_a_round_at_a_time(tmp_path):
    """An epoch's move on another number of ranks than logical shards: each rank's 77 MB of
    rows reach their places whole, and the rank's peak rises by a round and the move's
    indexes, not by its new rows as when they are written into their places."""
    world, growth = 2, {}
    for streamed in (True, False):
        context = rank_processes()
        results = context.Queue()
        processes = [context.Process(target=_streaming_rank,
                                     args=(r, world, str(tmp_path / f"store-{streamed}"), streamed, results))
                     for r in range(world)]
        for process in processes:
            process.start()
        got = [results.get(timeout=120) for _ in range(world)]
        for process in processes:
            process.join(60)
            assert process.exitcode == 0
        assert all(right and once for _, _, right, once in got), got
        growth[streamed] = max(mb for _, mb, _, _ in got)
    print("peak RSS a 77 MB move adds, streamed / into place:", growth[True], "/", growth[False], "MB")
    assert growth[False] > 70, "written into their places, the new rows take memory before the old ones go"
    assert growth[True] < 0.5 * 77, "streamed: the move's indexes (6 of 8 bytes a row: 14 MB), a round, slack"
    assert growth[True] < growth[False] / 2.5


@pytest.mark.parametrize("labels", ["the inputs' first values", "a strided view of the inputs' memory"])
def test_a_streamed_move_keeps_columns_that_share_their_memory_whole(labels):
    """Columns that share memory (labels viewing the inputs' values, contiguous or strided)
    are sent whole: the inputs' memory is not given back while the labels still need it."""
    from spark_torch_est.core.ranks import Ranks
    from spark_torch_est.ingest.canonical import stream_rows

    rows = 100_000
    if labels == "the inputs' first values":
        block = torch.arange(rows * 65, dtype=torch.float32).reshape(rows, 65)
        inputs, viewed = block, block.reshape(-1)[:rows]
    else:  # the inputs are the second half of the memory, the labels every other value of it all
        memory = torch.arange(rows * 2, dtype=torch.float32)
        inputs, viewed = memory[rows:].reshape(rows, 1), memory.reshape(rows, 2)[:, 0]
    table = Table([DenseColumn(inputs)], DenseColumn(viewed))
    expected_inputs, expected_labels = inputs.clone(), viewed.clone()
    order = torch.from_numpy(np.random.default_rng(1).permutation(rows))
    moved, positions, _ = stream_rows(table, torch.zeros(rows, dtype=torch.int64), order, rows,
                                      Ranks(0, 1, torch.device("cpu")), None)
    assert torch.equal(moved.inputs[0].tensor, expected_inputs[torch.argsort(order)[positions]])
    assert torch.equal(moved.labels.tensor, expected_labels[torch.argsort(order)[positions]])


def test_a_rank_stands_in_for_a_step_without_rows_with_the_row_at_its_first_position():
    """A step in which a rank trains no row (Lightning) runs the row at the rank's first
    position: the same row whatever order the rows came in and were kept in."""
    from spark_torch_est.core.ranks import Ranks
    from spark_torch_est.ingest.canonical import to_canonical

    stand_ins = []
    for order in (torch.arange(8), torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])):
        table = Table([DenseColumn(torch.arange(8.0)[order].unsqueeze(1))], DenseColumn(torch.arange(8.0)[order]))
        rows = to_canonical(table, [8], 1, 4, 0, Ranks(0, 1, torch.device("cpu")))
        stand_ins.append(float(rows.epoch(0, 0).stand_in()[1]))
    assert stand_ins[0] == stand_ins[1]


def _held_rank(rank: int, world: int, directory: str, forget: bool, results) -> None:
    """Two fits of a run from the start on this worker, reading a part of a Parquet file
    (rank 0: 9 rows, rank 1: 15); with ``forget`` rank 0's worker lets its rows go between them."""
    import pyarrow.parquet as pq

    from spark_torch_est.cluster import worker
    from spark_torch_est.core.spec import FilePart, FileSource, How
    from spark_torch_est.ingest import held
    from tests.helpers import features_schema

    torch.set_num_threads(1)
    path = os.path.join(directory, "rows.parquet")
    if rank == 0:
        x = np.random.default_rng(0).normal(size=(24, 8)).astype(np.float32)
        pq.write_table(pa.table({"f": pa.array(list(x), pa.list_(pa.float32())), "y": np.arange(24.0)}), path + ".tmp")
        os.rename(path + ".tmp", path)
    while not os.path.exists(path):
        pass
    source = FileSource(outputs=((FEATURES, ("f",), How.AS_IS), (LABEL, ("y",), How.AS_IS)),
                        parts=((FilePart(path, 0, 0, 9),), (FilePart(path, 0, 9, 24),)), digest="d")
    spec = task_spec(Target(epoch=2), hooks={"rows": StepRows()}, schema=features_schema(8), source=source,
                     world_size=world, batch_size=3)
    before = None
    for fit in range(2):
        if fit == 1 and forget and rank == 0:
            held.forget()
        launch = Launch(job_id=f"fit{fit}", secret=b"s" * 32)
        blob = worker.run_rank(spec, launch, iter([]), _FileBarrier(rank, world, f"{directory}/barrier{fit}"))
        ingested = held.held(worker._part_key(spec, rank))
        rows = ingested.train.inputs[0]
        results.put((fit, rank, ingested.layout.split("/")[0], len(ingested.train), rows is before, blob))
        before = rows


@pytest.mark.parametrize("forget", [False, True])
def test_held_rows_stay_laid_out_once_and_a_later_fit_trains_alike(forget, tmp_path):
    """A worker holds a part of a table for later fits: after the first fit it holds the
    rows of its logical shard (12 of the 24, not its part's 9 or 15 as well), and a second
    fit from the start trains every step on the rows of the first and to the same weights,
    whether every rank held its rows (nothing laid out again) or one worker let them go
    (the other reads its part again)."""
    world = 2
    context = rank_processes()
    results = context.Queue()
    processes = [context.Process(target=_held_rank, args=(r, world, str(tmp_path), forget, results))
                 for r in range(world)]
    for process in processes:
        process.start()
    got = [results.get(timeout=180) for _ in range(2 * world)]
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    assert sorted(tuple(result[:5]) for result in got) == [
        (fit, rank, "layout", 12, fit == 1 and not forget) for fit in (0, 1) for rank in (0, 1)], \
        "the second fit trains on the very rows held, unless a rank had to read its part again"
    first, second = (Checkpoint.from_bytes(next(r[5] for r in got if r[0] == fit and r[5])) for fit in (0, 1))
    assert second.hook_states["rows"]["steps"] == first.hook_states["rows"]["steps"]
    assert sorted(v for s in range(1, 5) for v in first.hook_states["rows"]["steps"][str(s)]) == list(range(24))
    assert torch.equal(_weights(second), _weights(first))


def _interrupted_rank(rank: int, world: int, directory: str, results) -> None:
    """Three fits of a run from the start, each reading this rank's part of a Parquet file
    anew (rank 0: 9,000 rows, rank 1: 15,000): the second fails in the middle of laying the
    rows out (after the first round of moving a column), with the rows as read held."""
    import pyarrow.parquet as pq

    from spark_torch_est.cluster import worker
    from spark_torch_est.cluster.failure import RankFailure
    from spark_torch_est.core.spec import FilePart, FileSource, How
    from spark_torch_est.ingest import canonical, held
    from tests.helpers import features_schema

    torch.set_num_threads(1)
    path = os.path.join(directory, "rows.parquet")
    if rank == 0:
        x = np.random.default_rng(0).normal(size=(24_000, 8)).astype(np.float32)
        pq.write_table(pa.table({"f": pa.array(list(x), pa.list_(pa.float32())), "y": np.arange(24_000.0)}),
                       path + ".tmp")
        os.rename(path + ".tmp", path)
    while not os.path.exists(path):
        pass
    source = FileSource(outputs=((FEATURES, ("f",), How.AS_IS), (LABEL, ("y",), How.AS_IS)),
                        parts=((FilePart(path, 0, 0, 9_000),), (FilePart(path, 0, 9_000, 24_000),)), digest="d")
    spec = task_spec(Target(epoch=1), schema=features_schema(8), source=source, world_size=world, batch_size=1000)
    write = canonical._Target.write
    for fit in range(3):
        if fit < 2:
            held.forget()  # the first two fits read the part (the third finds what the second left held)
        writes = []

        def failing(self, positions, rows, fit=fit, writes=writes):
            write(self, positions, rows)
            writes.append(len(rows))
            if fit == 1 and len(writes) == 2:
                raise RuntimeError("the rank's layout stops here")

        canonical._Target.write = failing
        launch = Launch(job_id=f"fit{fit}", secret=b"s" * 32)
        try:
            blob = worker.run_rank(spec, launch, iter([]), _FileBarrier(rank, world, f"{directory}/barrier{fit}"))
        except RankFailure:
            blob = b""
        finally:
            canonical._Target.write = write
        if fit == 1:  # the held rows as read, their memory given back where the layout sent them
            zeros = int((held.held(worker._part_key(spec, rank)).train.inputs[0].tensor == 0).all(1).sum())
            blob = zeros.to_bytes(8, "little")
        results.put((fit, rank, blob))


def test_held_rows_a_failed_layout_cut_short_are_read_again(tmp_path):
    """A layout gives the memory of the rows it sent back as it goes: when it fails midway,
    the rows the worker holds are partly gone, and the next fit reads them again and trains
    as the first did (not on zeros)."""
    world = 2
    context = rank_processes()
    results = context.Queue()
    processes = [context.Process(target=_interrupted_rank, args=(r, world, str(tmp_path), results))
                 for r in range(world)]
    for process in processes:
        process.start()
    got = {(fit, rank): blob for fit, rank, blob in (results.get(timeout=180) for _ in range(3 * world))}
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    zeroed = sum(int.from_bytes(got[1, rank], "little") for rank in range(world))
    assert zeroed > 1000, "the failed layout gave back the memory of rows it sent"
    first, third = (Checkpoint.from_bytes(got[fit, 0] or got[fit, 1]) for fit in (0, 2))
    assert torch.equal(_weights(third), _weights(first))


def _each_ranks_rows(shard_rows: list[int], batch: int, offset: int, world: int) -> list[torch.Tensor]:
    """Every rank's rows of an epoch on ``world`` ranks, in the order it trains them, as the
    contract says: each step's rows of every shard's order (shard 0's first) cut into
    ``world`` near-equal runs, a rank taking its run of each step in turn; then the rows the
    epoch trained before ``offset`` whose id is the rank's modulo ``world``."""
    plan, shards = EpochPlan(shard_rows, batch, offset), len(shard_rows)
    orders = [epoch_order(n, 7, 2, j) * shards + j for j, n in enumerate(shard_rows)]
    runs: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for step in range(plan.steps):
        ids = torch.cat([plan.positions(order, step) for order in orders])
        for w in range(world):
            runs[w].append(ids[len(ids) * w // world:len(ids) * (w + 1) // world])
    done = torch.cat([order[:offset] for order in orders])
    return [torch.cat([*runs[w], done[done % world == w]]) for w in range(world)]


@pytest.mark.parametrize("shard_rows, batch, offset, world", [
    ([7, 6], 2, 0, 3), ([7, 6], 3, 4, 3), ([5, 5, 4], 2, 3, 2), ([10, 3], 4, 2, 4), ([9, 9], 1, 8, 5),
    ([40, 39, 39], 5, 11, 2), ([4, 4], 3, 0, 1),
])
@pytest.mark.parametrize("chunk", [3, 1 << 16])
def test_each_rank_looks_up_where_its_rows_go_as_the_epoch_plan_says(shard_rows, batch, offset, world, chunk,
                                                                      monkeypatch):
    """On W != L ranks a rank finds where each of its rows goes (rank, position) without
    listing every id, a chunk of its rows at a time: what it finds equals the contract's
    lists, for rows held anywhere."""
    from spark_torch_est.core.ranks import Ranks
    from spark_torch_est.ingest import canonical
    from spark_torch_est.ingest.canonical import CanonicalRows

    monkeypatch.setattr(canonical, "_CHUNK_ROWS", chunk)

    shards = len(shard_rows)
    ids = torch.cat([torch.arange(n) * shards + j for j, n in enumerate(shard_rows)])
    ids = ids[torch.from_numpy(np.random.default_rng(0).permutation(len(ids)))]  # held in any order
    table = Table([DenseColumn(torch.zeros(len(ids), 1))], DenseColumn(torch.zeros(len(ids))))
    rows = CanonicalRows(table, shard_rows, batch, 7, Ranks(0, world, torch.device("cpu")), None, ids)
    to_rank, to_position, pieces, sizes = rows._destinations(EpochPlan(shard_rows, batch, offset), epoch=2)
    expected = _each_ranks_rows(shard_rows, batch, offset, world)
    assert sizes.tolist() == [len(e) for e in expected]
    for w in range(world):
        got = torch.empty(int(sizes[w]), dtype=torch.int64)
        got[to_position[to_rank == w].long()] = ids[to_rank == w]
        assert got.tolist() == expected[w].tolist()
    plan = EpochPlan(shard_rows, batch, offset)
    assert pieces.sum(1).tolist() == [plan.samples(step) for step in range(plan.steps)]


@pytest.mark.compat
def test_an_epoch_order_is_the_same_in_int32():
    """A move looks its rows up in orders drawn as int32 (half the memory): the same orders
    as the int64 ones every rank trains by, on this torch."""
    for rows in (0, 1, 2, 7, 1000, (1 << 16) + 3, 1 << 20):
        for part in range(3):
            assert torch.equal(epoch_order(rows, 11, 4, part, dtype=torch.int32).long(), epoch_order(rows, 11, 4, part))


def test_epoch_order_depends_on_seed_epoch_and_part_only():
    a = epoch_order(100, seed=1, epoch=2, part=0)
    assert torch.equal(a, epoch_order(100, seed=1, epoch=2, part=0))
    assert sorted(a.tolist()) == list(range(100))
    for other in (epoch_order(100, 2, 2, 0), epoch_order(100, 1, 3, 0), epoch_order(100, 1, 2, 1)):
        assert not torch.equal(a, other)


def test_an_epoch_plan_covers_the_rows_once_with_a_short_last_step():
    plan = EpochPlan([10, 9, 8], batch_size=4)
    order = torch.arange(10)
    assert plan.steps == 3
    assert plan.positions(order, 0).tolist() == [0, 1, 2, 3]
    assert plan.positions(order, 2).tolist() == [8, 9]                    # the rank's own last, partial batch
    assert plan.positions(torch.arange(8), 2).tolist() == []              # a shorter rank has none: no repeats
    assert [plan.samples(k) for k in range(3)] == [12, 12, 3]


def test_an_epoch_plan_from_an_offset_takes_what_is_left():
    plan = EpochPlan([10, 10], batch_size=3, offset=4)
    assert plan.steps == 2 and plan.positions(torch.arange(10), 0).tolist() == [4, 5, 6]
    assert [plan.samples(k) for k in range(2)] == [6, 6]
