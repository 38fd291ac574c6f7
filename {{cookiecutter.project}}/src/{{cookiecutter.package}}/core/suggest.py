"""The hint a message gives for a typo: the closest allowed name. The standard library only: the
k8s checks use it too, in the template's hook, before anything is installed."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(given: str, allowed: Iterable[str], prefix: str = "") -> str:
    """The hint for a typo (trainer.lrr, model=mpl), "did you mean <prefix><the closest of
    allowed>? ", to go before a message's "allowed: ..."; "" when none is close. Standard
    library only: the k8s checks use it too, before anything is installed."""
    # 0.65, not difflib's 0.6: mpl -> mlp (0.67) is a typo, width -> depth (0.6) is not
    close = difflib.get_close_matches(str(given), [str(a) for a in allowed], n=1, cutoff=0.65)
    return f"did you mean {prefix}{close[0]}? " if close else ""
