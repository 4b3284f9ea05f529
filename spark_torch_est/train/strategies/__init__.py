"""[executor] How a rank's model is distributed: DDP or FSDP."""
