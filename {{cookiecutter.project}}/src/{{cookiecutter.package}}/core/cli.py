"""Argument types and the parser of every command that takes options: a bad argument is one line
and exit 2 (Exit.CONFIG_ERROR), never the usage block. The standard library only: make k8s-doctor
must not import torch."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

from .exits import Exit

WEEK_S = 7 * 86400


class Parser(argparse.ArgumentParser):
    """A bad argument is one line and CONFIG_ERROR, without the usage block (the doctor, and
    make k8s-doctor, which must not import torch)."""

    def error(self, message: str) -> NoReturn:
        self.exit(Exit.CONFIG_ERROR, f"{self.prog}: {message}\n")


def at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(
                f"must be a whole number, at least {low}; got {text!r}"
            )
        return value

    return parse


def seconds(text: str, most: float = math.inf, most_said: str = "") -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= most):
        bound = f" and at most {most_said or f'{most:g}'}" if most < math.inf else ""
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds above 0{bound}; got {text!r}"
        )
    return value


def seconds_up_to(most: float, said: str) -> Callable[[str], float]:
    return lambda text: seconds(text, most, said)
