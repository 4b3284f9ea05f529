"""``python -m benchmarks.tuning [--rows N] [--max-epochs N]``: one grid (an MLP over 3
learning rates x 2 widths) tuned by ``TrainValidationSplit`` and by ``SuccessiveHalving``
(eta 2 from one epoch) on the same seeded split, in one local[2] session after a warm-up fit:
epochs trained (counted by a driver-side logger), wall time, and whether both pick the same map.
"""

from __future__ import annotations

import argparse
import time

from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit
from pyspark.sql import functions as F

from benchmarks.common import Workload, machine, register_by_value, spark_session
from benchmarks.contenders import estimator
from spark_torch_est import Logger
from spark_torch_est.tuning import SuccessiveHalving

FEATURES = 16


class EpochCounter(Logger):
    """Counts completed epochs of every run on the driver (shared by the tuners' copies)."""

    epochs = 0

    def on_epoch_end(self, **kwargs) -> None:
        EpochCounter.epochs += 1


def _timed(tune) -> tuple[object, int, float]:
    EpochCounter.epochs = 0
    started = time.perf_counter()
    model = tune()
    return model, EpochCounter.epochs, time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tuning")
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the table (default 200,000)")
    parser.add_argument("--max-epochs", type=int, default=6, help="maxEpochs of every map (default 6)")
    args = parser.parse_args(argv)
    register_by_value()
    print(machine())
    with spark_session(2, "bench-tuning") as spark:
        x = F.col("features")
        df = (spark.range(args.rows).select(F.array(*[F.randn(seed=i).cast("float") for i in range(FEATURES)])
                                            .alias("features"))
              .withColumn("label", F.sin(x[0]) + x[1] * x[2] + 0.5 * x[3] + 0.05 * F.randn(seed=99)).cache())
        est = estimator(Workload(features=FEATURES, batch_size=128, epochs=args.max_epochs), [],
                        loggers=[EpochCounter()])
        configs = [{"features": FEATURES, "hidden": width, "lr": lr}
                   for width in (16, 128) for lr in (0.001, 0.01, 0.05)]
        grid = ParamGridBuilder().addGrid(est.getParam("config"), configs).build()
        evaluator = RegressionEvaluator(metricName="rmse")
        est.copy(grid[0]).fit(df, duration="1ep")  # warm-up: the session's first job and Python workers
        tvs, tvs_epochs, tvs_s = _timed(lambda: TrainValidationSplit(
            estimator=est, estimatorParamMaps=grid, evaluator=evaluator, trainRatio=0.75, seed=0).fit(df))
        sh, sh_epochs, sh_s = _timed(lambda: SuccessiveHalving(
            estimator=est, estimatorParamMaps=grid, evaluator=evaluator, eta=2, minDuration="1ep",
            trainRatio=0.75, seed=0).fit(df))
    tvs_best = min(range(len(grid)), key=lambda i: tvs.validationMetrics[i])
    sh_best = sh.rungs[-1]["index"]
    print(f"\n{len(grid)} maps (config: 3 learning rates x 2 widths), {args.rows:,} rows, maxEpochs "
          f"{args.max_epochs}, 2 ranks on local[2]:")
    print(f"  TrainValidationSplit: {tvs_epochs} epochs ({len(grid)} maps x {args.max_epochs} + the refit of the "
          f"best on all rows), {tvs_s:.1f} s, best map {tvs_best} ({configs[tvs_best]}), "
          f"validation RMSE {tvs.validationMetrics[tvs_best]:.4f}")
    print(f"  SuccessiveHalving:    {sh_epochs} epochs, {sh_s:.1f} s, best map {sh_best} ({configs[sh_best]}), "
          f"validation RMSE {sh.validationMetrics[sh_best]:.4f}")
    print(f"  epochs {sh_epochs / tvs_epochs:.2f}x, wall time {sh_s / tvs_s:.2f}x; same winner: {tvs_best == sh_best}")
    for rung in sorted({r["rung"] for r in sh.rungs}):
        decisions = ", ".join(f"{r['index']}: {r['metric']:.4f}{'*' if r['kept'] else ''}"
                              for r in sh.rungs if r["rung"] == rung)
        print(f"  rung {rung} (map: RMSE, * kept): {decisions}")


if __name__ == "__main__":
    main()
