"""[driver] RuntimeParams: where and how a fit runs: ranks, slots, retries, checkpoints, memory, progress.

Params of TorchEstimator and TorchModel, their defaults and typed accessors. GENERATED from the table in
spark_torch_est/params/table.py by ``make params`` (``python -m spark_torch_est.params.codegen``):
do not edit by hand; tests/unit/params/test_table.py fails while this file is stale. See docs/params.md.
"""

from __future__ import annotations

from typing import TypeVar

from pyspark.ml.param import Param, Params, TypeConverters

from spark_torch_est.params.table import to_optional_bool, to_optional_int, to_optional_string

__all__ = ["RuntimeParams"]

_P = TypeVar("_P", bound=Params)


class RuntimeParams(Params):
    """Params of TorchEstimator and TorchModel: where and how a fit runs: ranks, slots, retries, checkpoints, memory,
    progress.
    """

    numWorkers: Param = Param(
        Params._dummy(), "numWorkers",
        "barrier tasks, i.e. DDP ranks",
        typeConverter=TypeConverters.toInt,
    )
    minWorkers: Param = Param(
        Params._dummy(), "minWorkers",
        "fewest ranks a launch may train with when fewer than numWorkers task slots are free after slotWaitTimeout "
        "(the global batch stays batchSize * numWorkers); None = numWorkers (no elasticity)",
        typeConverter=to_optional_int,
    )
    useGpu: Param = Param(
        Params._dummy(), "useGpu",
        "True/False, or None to use GPUs when tasks have them",
        typeConverter=to_optional_bool,
    )
    timeout: Param = Param(
        Params._dummy(), "timeout",
        "seconds before a rendezvous or collective that does not complete fails the fit",
        typeConverter=TypeConverters.toFloat,
    )
    slotWaitTimeout: Param = Param(
        Params._dummy(), "slotWaitTimeout",
        "seconds to wait for executors to offer numWorkers task slots",
        typeConverter=TypeConverters.toFloat,
    )
    maxRetries: Param = Param(
        Params._dummy(), "maxRetries",
        "relaunches of a failed job from the newest checkpoint",
        typeConverter=TypeConverters.toInt,
    )
    checkpointDir: Param = Param(
        Params._dummy(), "checkpointDir",
        "fsspec URL for periodic checkpoints (None = only the driver's copy)",
        typeConverter=to_optional_string,
    )
    checkpointInterval: Param = Param(
        Params._dummy(), "checkpointInterval",
        "how often to write to checkpointDir, e.g. '1ep' or '500ba'",
        typeConverter=TypeConverters.toString,
    )
    memoryBudgetMB: Param = Param(
        Params._dummy(), "memoryBudgetMB",
        "MB of a partition's rows a rank keeps in RAM; beyond that they spill to local files read per batch (0: never "
        "spill)",
        typeConverter=TypeConverters.toFloat,
    )
    keepIngestedMB: Param = Param(
        Params._dummy(), "keepIngestedMB",
        "MB of a DataFrame's rows each executor keeps on its local disk, as the ranks received them, so that later "
        "fits on the same unchanged DataFrame skip Spark's scan and shuffle; the least recently used are evicted past "
        "it (0: keep nothing)",
        typeConverter=TypeConverters.toFloat,
    )
    showProgress: Param = Param(
        Params._dummy(), "showProgress",
        "show a progress bar (a terminal or notebook), else progress and epoch lines on stderr (through logging where "
        "it is set up)",
        typeConverter=TypeConverters.toBoolean,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(
            numWorkers=2,
            minWorkers=None,
            useGpu=None,
            timeout=600.0,
            slotWaitTimeout=60.0,
            maxRetries=1,
            checkpointDir=None,
            checkpointInterval="1ep",
            memoryBudgetMB=4096.0,
            keepIngestedMB=8192.0,
            showProgress=True,
        )

    def getNumWorkers(self) -> int:
        """Gets the value of numWorkers or its default, ``2``."""
        return self.getOrDefault(self.numWorkers)

    def setNumWorkers(self: _P, value: int) -> _P:
        """Sets the value of numWorkers."""
        return self._set(numWorkers=value)

    def getMinWorkers(self) -> int | None:
        """Gets the value of minWorkers or its default, ``None``."""
        return self.getOrDefault(self.minWorkers)

    def setMinWorkers(self: _P, value: int | None) -> _P:
        """Sets the value of minWorkers."""
        return self._set(minWorkers=value)

    def getUseGpu(self) -> bool | None:
        """Gets the value of useGpu or its default, ``None``."""
        return self.getOrDefault(self.useGpu)

    def setUseGpu(self: _P, value: bool | None) -> _P:
        """Sets the value of useGpu."""
        return self._set(useGpu=value)

    def getTimeout(self) -> float:
        """Gets the value of timeout or its default, ``600.0``."""
        return self.getOrDefault(self.timeout)

    def setTimeout(self: _P, value: float) -> _P:
        """Sets the value of timeout."""
        return self._set(timeout=value)

    def getSlotWaitTimeout(self) -> float:
        """Gets the value of slotWaitTimeout or its default, ``60.0``."""
        return self.getOrDefault(self.slotWaitTimeout)

    def setSlotWaitTimeout(self: _P, value: float) -> _P:
        """Sets the value of slotWaitTimeout."""
        return self._set(slotWaitTimeout=value)

    def getMaxRetries(self) -> int:
        """Gets the value of maxRetries or its default, ``1``."""
        return self.getOrDefault(self.maxRetries)

    def setMaxRetries(self: _P, value: int) -> _P:
        """Sets the value of maxRetries."""
        return self._set(maxRetries=value)

    def getCheckpointDir(self) -> str | None:
        """Gets the value of checkpointDir or its default, ``None``."""
        return self.getOrDefault(self.checkpointDir)

    def setCheckpointDir(self: _P, value: str | None) -> _P:
        """Sets the value of checkpointDir."""
        return self._set(checkpointDir=value)

    def getCheckpointInterval(self) -> str:
        """Gets the value of checkpointInterval or its default, ``"1ep"``."""
        return self.getOrDefault(self.checkpointInterval)

    def setCheckpointInterval(self: _P, value: str) -> _P:
        """Sets the value of checkpointInterval."""
        return self._set(checkpointInterval=value)

    def getMemoryBudgetMB(self) -> float:
        """Gets the value of memoryBudgetMB or its default, ``4096.0``."""
        return self.getOrDefault(self.memoryBudgetMB)

    def setMemoryBudgetMB(self: _P, value: float) -> _P:
        """Sets the value of memoryBudgetMB."""
        return self._set(memoryBudgetMB=value)

    def getKeepIngestedMB(self) -> float:
        """Gets the value of keepIngestedMB or its default, ``8192.0``."""
        return self.getOrDefault(self.keepIngestedMB)

    def setKeepIngestedMB(self: _P, value: float) -> _P:
        """Sets the value of keepIngestedMB."""
        return self._set(keepIngestedMB=value)

    def getShowProgress(self) -> bool:
        """Gets the value of showProgress or its default, ``True``."""
        return self.getOrDefault(self.showProgress)

    def setShowProgress(self: _P, value: bool) -> _P:
        """Sets the value of showProgress."""
        return self._set(showProgress=value)
