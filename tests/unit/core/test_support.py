"""What the installed releases carry: a feature a release lacks is refused naming both versions."""

from __future__ import annotations

import re
from importlib.metadata import version

import pytest

from spark_torch_est.core.support import Feature, installed, require
from spark_torch_est.errors import InvalidInputError


def test_installed_reads_major_and_minor_whatever_the_local_label():
    assert installed("torch") == tuple(int(p) for p in version("torch").split("+")[0].split(".")[:2])


def test_a_feature_newer_than_the_installed_release_is_refused_naming_both():
    future = Feature("strategy=\"warp\"", "torch", (99, 0), "torch.warp")
    with pytest.raises(InvalidInputError, match=rf'strategy="warp" needs torch >= 99.0 \(torch.warp\); this '
                                                rf'environment has torch {re.escape(version("torch"))}'):
        require(future)
    require(Feature("anything", "torch", installed("torch"), "what it has"))  # as old as installed: allowed
