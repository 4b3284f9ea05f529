"""[both] The checkpoint format (:mod:`.checkpoint`) and where checkpoints are stored
(:mod:`.storage`: local paths and fsspec URLs)."""
