"""Hydra configs, shipped inside the package so an installed project finds them (pkg://)."""
