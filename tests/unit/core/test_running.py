"""The loggers users configure keep the names of 0.1.0, wherever the modules live."""

import logging

from spark_torch_est import Progress
from spark_torch_est.cluster.control import Launches
from spark_torch_est.cluster.messages import RankMessage
from spark_torch_est.core.progress import Target
from spark_torch_est.loggers.view import DriverView


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_handler_on_the_0_1_0_names_and_on_the_fits_log_sees_their_lines():
    """A user's logging configuration from 0.1.0 (``spark_torch_est.progress`` for the progress
    and epoch lines, ``spark_torch_est.worker`` for the ranks' records) keeps working after the
    modules moved into folders, and the fit's own log (its relaunches) is ``spark_torch_est.fit``."""
    names = ("spark_torch_est.progress", "spark_torch_est.worker", "spark_torch_est.fit")
    handlers = {name: _Lines() for name in names}
    for name, handler in handlers.items():
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        view = DriverView(False, Progress(), Target(epoch=1), samples_per_step=8)
        view.handle(RankMessage.for_epoch({"epoch": 1, "train_loss": 0.5}))
        view.handle(RankMessage.for_log(1, logging.WARNING, "user", "hello"))
        view.close()
        Launches(max_retries=1).relaunch(True, "after a system failure: peer died")
    finally:
        for name, handler in handlers.items():
            logging.getLogger(name).removeHandler(handler)
            logging.getLogger(name).setLevel(logging.NOTSET)
    assert handlers["spark_torch_est.progress"].lines == ["epoch 1: train_loss=0.5"]
    assert handlers["spark_torch_est.worker"].lines == ["[rank 1] user: hello"]
    assert handlers["spark_torch_est.fit"].lines == ["relaunching training (1 of 1) after a system failure: peer died"]
