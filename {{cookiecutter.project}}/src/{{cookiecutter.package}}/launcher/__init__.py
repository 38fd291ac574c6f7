"""The launcher's machinery: torchrun's options, the run dir before start, how workers ended."""
