"""[both] The barrier job: the driver's launcher and failure policy, a task's worker, the
rendezvous behind the store gate, and the authenticated channel with its messages."""
