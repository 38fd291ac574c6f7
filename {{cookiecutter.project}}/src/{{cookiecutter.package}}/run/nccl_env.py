"""The NCCL environment each worker writes before its process group exists: NCCL reads its
variables once, when the first communicator is made. train's main_worker and bench call it, and
end on its ConfigError: a /dev/shm too small for the transport the settings choose."""

import logging
import os
from pathlib import Path

import torch

from ..config.error import ConfigError
from ..config.schema import TrainConfig
from ..core.world import World
from ..nccl import decision as nccl
from ..nccl import probe

log = logging.getLogger(__name__)


def apply_nccl_env(cfg: TrainConfig, world: World, run_dir: Path, cuda: bool) -> nccl.Decision:
    """NCCL reads its variables once, when the first communicator is made: write them first.
    cuda: the caller's uses_cuda(cfg.dist.backend), asked once."""
    facts = probe.shared_node_facts(run_dir, world) if cfg.nccl.auto else probe.basic_facts(world)
    (run_dir / "nccl").mkdir(parents=True, exist_ok=True)
    recorder = nccl.flight_recorder_env(str(run_dir / "nccl" / "trace_rank_"), torch.__version__)
    explicit = nccl.explicit_settings(cfg.dist.async_error_handling)
    decision = nccl.decide(cfg.nccl, facts, os.environ, defaults=recorder, explicit=explicit)
    shm_problem = nccl.shm_error(facts, decision.env) if cuda else None
    if shm_problem:
        raise ConfigError(shm_problem)
    os.environ.update(decision.env)
    if world.main and cuda:  # over gloo none of this is used: say nothing of it
        if cfg.nccl.auto:
            log.info("node probe: %s", facts.summary())
        log.info("NCCL environment (nccl=%s):\n%s", cfg.nccl.profile, decision.report())
        for warning in decision.warnings:
            log.warning(warning)
    return decision
