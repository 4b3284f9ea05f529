"""[executor] One rank's training: the loop (:mod:`.loop`), its step (:mod:`.step`) and
state (:mod:`.run_state`), the user's creators and hooks, losses, metrics, precision,
devices, and the strategies that wrap the model (:mod:`.strategies`)."""
