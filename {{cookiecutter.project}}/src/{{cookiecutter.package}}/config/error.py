"""ConfigError, the one error a bad config value raises, naming the key; every schema module and
check raises it, and every command ends on it with Exit.CONFIG_ERROR. did_you_mean: the hint its
message gives on a typo."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from ..core.exits import Exit


class ConfigError(ValueError):
    """A config value that is well typed but not allowed. The message names the key."""

    exit = Exit.CONFIG_ERROR


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value}: {allowed}")


def did_you_mean(given: str, allowed: Iterable[str], prefix: str = "") -> str:
    """The hint for a typo (trainer.lrr, model=mpl), "did you mean <prefix><the closest of
    allowed>? ", to go before a message's "allowed: ..."; "" when none is close. Standard
    library only: the k8s checks use it too, before anything is installed."""
    # 0.65, not difflib's 0.6: mpl -> mlp (0.67) is a typo, width -> depth (0.6) is not
    close = difflib.get_close_matches(str(given), [str(a) for a in allowed], n=1, cutoff=0.65)
    return f"did you mean {prefix}{close[0]}? " if close else ""
