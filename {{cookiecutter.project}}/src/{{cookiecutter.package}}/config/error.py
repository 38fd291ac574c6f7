"""ConfigError, the one error a bad config value raises, naming the key; every schema module and
check raises it, and every command ends on it with Exit.CONFIG_ERROR. A message's hint on a typo
is core.suggest.did_you_mean."""

from __future__ import annotations

from typing import Any

from ..core.exits import Exit


class ConfigError(ValueError):
    """A config value that is well typed but not allowed. The message names the key."""

    exit = Exit.CONFIG_ERROR


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value}: {allowed}")
