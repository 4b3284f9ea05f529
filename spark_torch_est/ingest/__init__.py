"""[both] From a DataFrame or Parquet files to each rank's tensors.

Driver side: which columns a fit reads and how (:mod:`.frames`), Parquet read directly
(:mod:`.parquet_plan`), and the registry of rows kept between fits (:mod:`.kept_registry`).
Rank side: Arrow batches to a rank's ingested rows, a table per role (:mod:`.tables`) of
typed columns (:mod:`.columns`), Parquet parts (:mod:`.parquet_read`), kept rows on the
executor's disk (:mod:`.kept`) and held rows in the worker's memory (:mod:`.held`), the
ranks' agreement on shapes and steps (:mod:`.agreement`), and the run's logical shards,
which give an epoch one order on any number of ranks (:mod:`.canonical`).
See docs/architecture.md, "Vocabulary".
"""
