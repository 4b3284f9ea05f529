"""``python -m benchmarks.fixed_cost [--fits N]``: what a fit costs beyond its training steps on
small data (500 rows x 8 features, an MLP 8-32-32-1, batch 32, 20 epochs) in a warm local[2]
session, on 1 and 2 ranks: the call to the first step and the last step to the return, the
median of N fits; then CrossValidator over 9 maps (3 learning rates x 3 widths, 3 folds, 1
rank) against scikit-learn's GridSearchCV over the same maps (MLPRegressor, SGD, 20 epochs).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import numpy as np
from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

from benchmarks.common import Probe, Workload, machine, register_by_value, spark_session
from benchmarks.contenders import estimator
from spark_torch_est import TorchEstimator

SMALL = Workload(rows=500, features=8, hidden=32, epochs=20, batch_size=32, ranks=1)
LRS, WIDTHS = (0.001, 0.01, 0.05), (8, 32, 128)
ROUNDS = 2  # each search twice: the first in the session starts the Python workers its evaluations use beside the fits


def _fixed_cost(est: TorchEstimator, df, probe: Probe, fits: int) -> tuple[float, float, float]:
    """Medians of (call to first step, last step to return, whole fit) over ``fits`` fits."""
    spans = []
    for _ in range(fits):
        fresh = est.copy()
        called = time.time()
        fresh.fit(df)
        done = time.time()
        rank0 = probe.reports(est.getNumWorkers())[0]  # its first and last optimizer step
        spans.append((rank0["fit_first"] - called, done - rank0["last"], done - called))
    return tuple(statistics.median(column) for column in zip(*spans))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fixed_cost")
    parser.add_argument("--fits", type=int, default=5, help="fits timed per number of ranks (default 5)")
    args = parser.parse_args(argv)
    register_by_value()
    print(machine())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SMALL.rows, SMALL.features)).astype(np.float32)
    y = np.sin(x[:, 0]) + x[:, 1] * x[:, 2] + 0.1 * rng.normal(size=SMALL.rows)
    with tempfile.TemporaryDirectory(prefix="bench-fixed-cost-") as scratch, \
            spark_session(2, "bench-fixed-cost") as spark:
        df = spark.createDataFrame([(row.tolist(), float(t)) for row, t in zip(x, y)], ["features", "label"]).cache()
        df.count()
        probe = Probe(scratch, "fit")
        est = estimator(SMALL, [probe])
        print(f"\n{SMALL.rows} rows, {SMALL.epochs} epochs, batch {SMALL.batch_size}, warm session (median of "
              f"{args.fits} fits):")
        for workers in (1, 2):
            est.setNumWorkers(workers).copy().fit(df)  # warm-up: Python workers, imports
            before, after, whole = _fixed_cost(est, df, probe, args.fits)
            print(f"  numWorkers={workers}: fit {whole:.2f} s = call to first step {before:.2f} s + steps "
                  f"{whole - before - after:.2f} s + last step to return {after:.2f} s: fixed cost "
                  f"{before + after:.2f} s")
        grid = ParamGridBuilder().addGrid(est.getParam("config"), [
            {**SMALL.config, "hidden": w, "lr": lr} for w in WIDTHS for lr in LRS]).build()
        cv_s = []
        for _ in range(ROUNDS):
            started = time.perf_counter()
            CrossValidator(estimator=est.setNumWorkers(1).setHooks(None), estimatorParamMaps=grid, numFolds=3,
                           evaluator=RegressionEvaluator(), seed=0).fit(df)
            cv_s.append(time.perf_counter() - started)
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.model_selection import GridSearchCV
    from sklearn.neural_network import MLPRegressor

    warnings.filterwarnings("ignore", category=ConvergenceWarning)  # 20 epochs, as the fits train

    sk_s = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        GridSearchCV(MLPRegressor(solver="sgd", batch_size=SMALL.batch_size, max_iter=SMALL.epochs, random_state=0),
                     {"hidden_layer_sizes": [(w, w) for w in WIDTHS], "learning_rate_init": LRS}, cv=3).fit(x, y)
        sk_s.append(time.perf_counter() - started)
    for name, cv, sk in (("first in the session", cv_s[0], sk_s[0]), ("again", cv_s[1], sk_s[1])):
        print(f"  CrossValidator, 9 maps x 3 folds + refit (1 rank), {name}: {cv:.1f} s; scikit-learn's "
              f"GridSearchCV on the same maps: {sk:.1f} s ({cv / sk:.1f}x)")


if __name__ == "__main__":
    main()
