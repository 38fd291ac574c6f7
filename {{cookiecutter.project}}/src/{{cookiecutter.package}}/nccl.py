"""The NCCL decision: config, node facts and the inherited environment in; the env to write out.

Pure functions, standard library only, so every rule is testable without GPUs.

Precedence, lowest first:
  1. NCCL's own default (the variable stays unset);
  2. the `auto` profile's choice, from the node facts;
  3. a variable already in the environment (e.g. the Kubernetes Job's env block);
  4. an explicit, non-null config field (`nccl.p2p_disable=true`, `nccl.env.NCCL_ALGO=Ring`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

# Config field -> the NCCL variable it sets. One field, one variable.
FIELD_VARS = {
    "p2p_disable": "NCCL_P2P_DISABLE",
    "ib_disable": "NCCL_IB_DISABLE",
    "shm_disable": "NCCL_SHM_DISABLE",
    "socket_ifname": "NCCL_SOCKET_IFNAME",
    "debug": "NCCL_DEBUG",
    "debug_subsys": "NCCL_DEBUG_SUBSYS",
}
NCCL_VAR = re.compile(r"NCCL_[A-Z0-9_]+")
DEFAULT_SOURCE = "unset: NCCL decides"


@dataclass(frozen=True)
class NodeFacts:
    """What the probe saw on this node."""

    gpu_count: int
    nvlink_pairs: frozenset[tuple[int, int]]  # (i, j) with i < j, joined by NVLink
    ib_active_ports: int
    world_size: int
    local_world_size: int

    @property
    def multi_node(self) -> bool:
        return self.world_size > self.local_world_size

    @property
    def pcie_pairs(self) -> list[tuple[int, int]]:
        pairs = [(i, j) for i in range(self.gpu_count) for j in range(i + 1, self.gpu_count)]
        return [pair for pair in pairs if pair not in self.nvlink_pairs]


@dataclass(frozen=True)
class AutoChoice:
    """One rule's outcome: a value for `var`, or None to leave it to NCCL, and the evidence."""

    var: str
    value: str | None
    reason: str


@dataclass(frozen=True)
class Setting:
    value: str | None  # None: unset, NCCL's default applies
    source: str


@dataclass(frozen=True)
class Decision:
    settings: dict[str, Setting]  # every NCCL variable we set, saw or reasoned about
    warnings: tuple[str, ...]

    @property
    def env(self) -> dict[str, str]:
        """The variables to write into os.environ before init_process_group."""
        return {var: s.value for var, s in self.settings.items() if s.value is not None}

    def report(self) -> str:
        width = max((len(var) for var in self.settings), default=0)
        lines = [
            f"  {var:<{width}} = {s.value if s.value is not None else '(unset)':<6} {s.source}"
            for var, s in sorted(self.settings.items())
        ]
        return "\n".join(lines) if lines else "  (no NCCL variables set: NCCL decides everything)"


def env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, Enum):
        return value.name
    return str(value)


def config_env(nccl_cfg: Any) -> dict[str, tuple[str, str]]:
    """Explicit config values as {var: (value, source)}. Fields left null are not listed."""
    explicit = {}
    for field, var in FIELD_VARS.items():
        value = getattr(nccl_cfg, field)
        if value is not None:
            explicit[var] = (env_value(value), f"config nccl.{field}")
    for var, value in nccl_cfg.env.items():
        explicit[var] = (env_value(value), f"config nccl.env.{var}")
    return explicit


def config_errors(nccl_cfg: Any) -> list[str]:
    """Problems that typing alone cannot catch, one line each, naming the key."""
    errors = []
    field_of = {var: field for field, var in FIELD_VARS.items()}
    for var in nccl_cfg.env:
        if not NCCL_VAR.fullmatch(var):
            errors.append(f"nccl.env.{var}: keys must be NCCL_* variable names (A-Z, 0-9, _)")
        elif var in field_of:
            errors.append(f"nccl.env.{var}: set it with nccl.{field_of[var]} instead")
    return errors


def auto_choices(facts: NodeFacts) -> list[AutoChoice]:
    """The `auto` profile's rules. Until the P2P probe exists, P2P is never disabled."""
    choices = []
    if facts.gpu_count > 1 and facts.local_world_size > 1:
        if facts.nvlink_pairs:
            pairs = ", ".join(f"GPU{i}-GPU{j}" for i, j in sorted(facts.nvlink_pairs))
            choices.append(
                AutoChoice("NCCL_P2P_DISABLE", None, f"auto: NVLink between {pairs}, P2P kept")
            )
        if facts.pcie_pairs:
            pairs = ", ".join(f"GPU{i}-GPU{j}" for i, j in facts.pcie_pairs)
            choices.append(
                AutoChoice(
                    "NCCL_P2P_DISABLE",
                    None,
                    f"auto: PCIe between {pairs}, no evidence P2P is broken",
                )
            )
    if not facts.multi_node:
        choices.append(AutoChoice("NCCL_IB_DISABLE", "1", "auto: single node, InfiniBand unused"))
    elif facts.ib_active_ports == 0:
        choices.append(
            AutoChoice("NCCL_IB_DISABLE", "1", "auto: several nodes, no active InfiniBand port")
        )
    else:
        choices.append(
            AutoChoice(
                "NCCL_IB_DISABLE",
                None,
                f"auto: several nodes, {facts.ib_active_ports} active IB ports",
            )
        )
    return choices


def merge_auto(choices: list[AutoChoice]) -> dict[str, Setting]:
    """One setting per variable; a concrete value beats "leave it", reasons are joined."""
    merged: dict[str, Setting] = {}
    for choice in choices:
        earlier = merged.get(choice.var)
        value = choice.value if choice.value is not None else (earlier.value if earlier else None)
        source = (
            f"{earlier.source}; {choice.reason.removeprefix('auto: ')}"
            if earlier
            else choice.reason
        )
        merged[choice.var] = Setting(value, source)
    return merged


def decide(nccl_cfg: Any, facts: NodeFacts | None, inherited: Mapping[str, str]) -> Decision:
    """The NCCL environment for one process. Identical inputs give every rank the same env."""
    settings: dict[str, Setting] = {}
    warnings = []
    if nccl_cfg.auto and facts is not None:
        settings.update(merge_auto(auto_choices(facts)))
    for var, value in inherited.items():
        if NCCL_VAR.fullmatch(var):
            earlier = settings.get(var)
            overruled = (
                f" (over {earlier.source} -> {earlier.value})"
                if earlier and earlier.value != value
                else ""
            )
            settings[var] = Setting(value, f"environment{overruled}")
    for var, (value, source) in config_env(nccl_cfg).items():
        if var in inherited and inherited[var] != value:
            warnings.append(
                f"{source}={value} overrides {var}={inherited[var]} from the environment; "
                f"{var}={value} is in force"
            )
        settings[var] = Setting(value, source)
    return Decision(settings, tuple(warnings))
