"""[both] What the installed torch and pyspark carry, checked on the driver before any job.

The package runs on every row of the support matrix (docs/cluster.md, "Support matrix"),
from Spark 3.5.0 and torch 2.3.1 on. A feature that needs a newer release than the one
installed is refused here with the version it needs, never met as an AttributeError on an
executor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.metadata import version

from spark_torch_est.errors import InvalidInputError

__all__ = ["Feature", "FSDP", "FSDP_CPU", "CONNECT_ML", "PREDICT_UDF", "installed", "require"]


@dataclass(frozen=True)
class Feature:
    """A feature and the release it needs.

    Attributes:
        what: How the user asks for it (a Param value, a method).
        package: The distribution it needs ("torch" or "pyspark").
        needs: The oldest release of ``package`` that carries it.
        why: What in that release it uses.
    """

    what: str
    package: str
    needs: tuple[int, int]
    why: str


FSDP = Feature('strategy="fsdp"', "torch", (2, 6), "FSDP2's public torch.distributed.fsdp.fully_shard")
FSDP_CPU = Feature('strategy="fsdp" on CPU ranks', "torch", (2, 7),
                   "FSDP2 on CPU: torch 2.6's fails in its first forward, CPU streams having no record_event")
CONNECT_ML = Feature("pyspark.ml estimators under Spark Connect", "pyspark", (4, 0),
                     "pyspark.ml's Spark Connect support")
PREDICT_UDF = Feature("predict_udf()", "pyspark", (4, 1), "pyspark.sql.functions.arrow_udf")


def installed(package: str) -> tuple[int, int]:
    """``(major, minor)`` of an installed distribution ("2.3.1+cu121" -> (2, 3))."""
    major, minor = re.match(r"(\d+)\.(\d+)", version(package)).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def require(feature: Feature) -> None:
    """Refuses a feature the installed release does not carry.

    Raises:
        InvalidInputError: Names the feature, the release it needs and the one installed.
    """
    if installed(feature.package) < feature.needs:
        needed = ".".join(map(str, feature.needs))
        raise InvalidInputError(f"{feature.what} needs {feature.package} >= {needed} ({feature.why}); this "
                                f"environment has {feature.package} {version(feature.package)}")
