"""The checkpoints of runs one job trains in turn, packed by rank 0 and unpacked by the driver:
what the driver unpacks is what was packed, and anything else is refused."""

from __future__ import annotations

import pytest

from spark_torch_est.core.protocol import pack_runs, unpack_runs


def test_packed_checkpoints_unpack_as_they_were_packed_delivered_ones_empty():
    runs = [b"first checkpoint", b"", b"\x00" * 1000]
    assert unpack_runs(pack_runs(runs), 3) == runs


@pytest.mark.parametrize("data, count", [
    (pack_runs([b"a", b"b"]), 3),  # another count
    (pack_runs([b"a", b"b"])[:-1], 2),  # cut short
    (pack_runs([b"a", b"b"]) + b"x", 2),  # more than its lengths
    (b"NOT-RUNS" + pack_runs([b"a"])[8:], 1),  # no marker
    (b"STE-RUNS", 1),
    (b"", 0),
])
def test_what_is_not_the_packed_checkpoints_of_the_runs_is_refused(data, count):
    with pytest.raises(ValueError, match="runs trained together"):
        unpack_runs(data, count)
