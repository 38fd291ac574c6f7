"""NCCL: the decision (pure functions), node facts, the gate all-reduce, bus bandwidth."""
