"""[both] The vocabulary every part of the package shares: a task's spec, progress and
durations, input schemas, the ranks' order, RNG state, optional features by release, the
registry of running fits, and every reach into Spark's JVM (:mod:`.jvm`).

Nothing here imports another folder of the package.
"""
