"""[both] Scoring a fitted model: ``transform`` and ``evaluate`` as batched Arrow tasks
(:mod:`.inference`) and ``predict_udf`` (:mod:`.predict_udf`)."""
