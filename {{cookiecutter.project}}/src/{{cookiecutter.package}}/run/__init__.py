"""A training run's machinery: the loop, checkpoints, stopping, the run dir, DDP, torch.compile."""
