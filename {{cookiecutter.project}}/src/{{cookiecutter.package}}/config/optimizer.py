"""What the optimizer group's keys mean: the class optimizer._target_ names and the keywords it is
built with, checked before any process starts (validate.check_composed, on the node that trains:
rendering k8s/ needs no torch), then tried by each worker (try_optimizer), one line per refusal.
run/optimizer.py builds it."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from .error import ConfigError
from .schema import OptimizerConfig

# Keywords with a key of their own: set there, not in optimizer.kwargs.
OWN_KEYS = {
    "params": "the parameter groups are the model's",
    "lr": "set trainer.lr, the schedule's peak",
    "weight_decay": "set optimizer.weight_decay",
    "betas": "set optimizer.betas",
    "eps": "set optimizer.eps",
    "fused": "set optimizer.fused",
}
# Classes whose step() the loop cannot drive: it passes no closure and its gradients are dense.
UNDRIVABLE = {"LBFGS": "needs a closure at every step", "SparseAdam": "needs sparse gradients"}


def optimizer_class(target: str) -> type:
    """The class optimizer._target_ names; ConfigError unless it is a torch.optim.Optimizer."""
    import torch  # here: composing a config for k8s/ needs no torch

    module_name, _, name = target.rpartition(".")
    found = None
    if module_name and name:
        try:
            found = getattr(importlib.import_module(module_name), name, None)
        except Exception:  # a module that is not there, or fails to import: not an optimizer
            found = None
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise ConfigError(
            f"optimizer._target_={target}: must be a torch.optim.Optimizer subclass by import "
            "path, e.g. torch.optim.AdamW or torch.optim.SGD"
        )
    if found.__name__ in UNDRIVABLE:
        raise ConfigError(
            f"optimizer._target_={target}: {UNDRIVABLE[found.__name__]}, which the training "
            "loop does not give; choose another, e.g. torch.optim.AdamW"
        )
    return found


def accepted_keywords(cls: type) -> set[str] | None:
    """The keywords the class's constructor takes; None if it takes any (**kwargs)."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters} - {"self"}


def keyword_kind(cls: type, keyword: str) -> str | None:
    """ "bool" or "number" where the constructor's default for the keyword is one, else None: a
    class's own checks let a truthy string stand for true (amsgrad="maybe")."""
    parameter = inspect.signature(cls.__init__).parameters.get(keyword)
    default = None if parameter is None else parameter.default
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, (int, float)):
        return "number"
    return None


def takes(cls: type, keyword: str) -> bool:
    taken = accepted_keywords(cls)
    return taken is None or keyword in taken


def keywords(cfg: OptimizerConfig) -> dict[str, Any]:
    """The class's keywords the config gives, but lr, weight_decay (each group has its own) and
    fused (the device decides): null keys are left to the class's defaults."""
    given: dict[str, Any] = {"eps": cfg.eps}
    if cfg.betas is not None:
        given["betas"] = tuple(cfg.betas)
    return {key: value for key, value in given.items() if value is not None} | dict(cfg.kwargs)


def check_optimizer(cfg: OptimizerConfig) -> None:
    """The class exists and takes every keyword given, of the kind its defaults are. What the
    class itself refuses, try_optimizer finds."""
    cls = optimizer_class(cfg._target_)
    taken = accepted_keywords(cls)
    for key in cfg.kwargs:
        if key in OWN_KEYS:
            raise ConfigError(f"optimizer.kwargs.{key}: {OWN_KEYS[key]}")
        if taken is not None and key not in taken:
            allowed = ", ".join(sorted(taken - OWN_KEYS.keys()))
            raise ConfigError(
                f"optimizer.kwargs.{key}: {cfg._target_} takes no keyword {key}; it takes: "
                f"{allowed}"
            )
        kind = keyword_kind(cls, key)
        value = cfg.kwargs[key]
        if kind == "bool" and not isinstance(value, bool):
            raise ConfigError(f"optimizer.kwargs.{key}={value}: must be true or false")
        if kind == "number" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"optimizer.kwargs.{key}={value}: must be a number")
    for key, value in (("betas", cfg.betas), ("eps", cfg.eps)):
        if value is not None and taken is not None and key not in taken:
            raise ConfigError(f"optimizer.{key}={value}: {cfg._target_} takes none; set it to null")
    if cfg.weight_decay and not takes(cls, "weight_decay"):
        raise ConfigError(
            f"optimizer.weight_decay={cfg.weight_decay}: {cfg._target_} has no weight decay; "
            "set it to 0"
        )


def try_optimizer(cfg: OptimizerConfig, lr: float, on_cuda: bool) -> None:
    """The class accepts the keywords' values: built once on a one-element tensor (the class's
    own checks, momentum < 0 say, as one line). For workers on the CPU it takes a step too: some
    checks wait for one (capturable=true needs a GPU). In the workers, not the launcher: building
    an optimizer imports dynamo, seconds a launch would pay twice."""
    import torch

    cls = optimizer_class(cfg._target_)
    trial = [torch.zeros(1, requires_grad=True)]
    decay = {"weight_decay": cfg.weight_decay} if takes(cls, "weight_decay") else {}
    try:
        optimizer = cls(trial, lr=lr, **decay, **keywords(cfg))
    except Exception as err:  # the class's own checks: ValueError mostly, TypeError for a type
        reason = " ".join(str(err).split())[:300]
        raise ConfigError(f"optimizer: {cfg._target_} refuses its keywords: {reason}") from None
    if on_cuda:  # a trial step would take GPU memory in each worker; their first step checks
        return
    trial[0].grad = torch.ones_like(trial[0])
    try:
        optimizer.step()
    except Exception as err:  # AssertionError (capturable), TypeError (a closure it needs), ...
        reason = " ".join(str(err).split())[:300]
        raise ConfigError(
            f"optimizer: {cfg._target_} fails a step on the CPU with its keywords: {reason}"
        ) from None


def upgraded(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config from before the optimizer group (AdamW, its keys under trainer) in
    today's shape, as it trained: AdamW with its defaults, no EMA, no early stopping. (Its
    weight decay applied to every parameter; today's to those of 2 or more dimensions.)"""
    trainer = saved.get("trainer")
    if "optimizer" in saved or not isinstance(trainer, dict) or "weight_decay" not in trainer:
        return saved
    trainer = dict(trainer)
    optimizer = {
        "_target_": "torch.optim.AdamW",
        "weight_decay": trainer.pop("weight_decay"),
        "betas": None,
        "eps": None,
        "fused": trainer.pop("fused_optimizer", True),
        "kwargs": {},
    }
    trainer.setdefault("ema_decay", None)
    trainer.setdefault("patience", None)
    return {**saved, "trainer": trainer, "optimizer": optimizer}
