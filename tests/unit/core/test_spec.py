"""TaskSpec: a fit shrunk to fewer ranks keeps its global batch."""

import pytest

from tests.helpers import task_spec


@pytest.mark.parametrize("workers, batch, ranks, expected", [(2, 32, 1, 64), (3, 64, 2, 96), (3, 63, 2, 95),
                                                             (4, 10, 3, 14)])
def test_a_shrunk_fit_takes_the_global_batch_on_fewer_ranks(workers, batch, ranks, expected):
    spec = task_spec(world_size=workers, batch_size=batch)
    shrunk = spec.shrunk(ranks, None)
    assert (shrunk.world_size, shrunk.batch_size) == (ranks, expected)
    assert shrunk.batch_size * ranks >= batch * workers > (shrunk.batch_size - 1) * ranks
    assert (shrunk.run_id, shrunk.fit_id, shrunk.target) == (spec.run_id, spec.fit_id, spec.target)
