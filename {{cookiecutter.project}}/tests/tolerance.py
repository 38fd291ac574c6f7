"""How far apart two runs of the same math may land when they add in another order.

DDP against FSDP2, one process against two, one batch against accumulated micro-batches: each
pair computes the same sums, but in another order (another reduction, another split of a
matmul), and float addition is not associative. How far that moves a result depends on the
dtype and on how many numbers each sum adds, not on the machine: a CPU with other vector units
only picks another order. So the suites derive these tolerances here, and keep exact equality
where a path promises it (the same world size resumed: bit for bit).
"""

from __future__ import annotations

import math

import torch

# Higham and Mary (SIAM J. Sci. Comput. 41(5), 2019): a sum of n terms, each addition rounding
# independently, is within LAMBDA * sqrt(n) * u of the exact sum, relative to the sum of the
# terms' magnitudes, except with probability 2 * exp(-LAMBDA**2 / 2): 3e-8 at LAMBDA = 6. The
# worst case, n * u, is never approached by real data and would leave these tests toothless.
LAMBDA = 6.0


def reordered(terms: int, steps: int = 1, dtype: torch.dtype = torch.float32) -> float:
    """The relative tolerance for a result reached through `steps` rounds of sums of `terms`
    numbers each, added in another order. Training carries each step's rounding into the next,
    so the result has been through steps x terms roundings, which the bound above takes as one
    long sum; u, the unit roundoff, is half of dtype's eps."""
    unit_roundoff = torch.finfo(dtype).eps / 2
    return LAMBDA * math.sqrt(steps * terms) * unit_roundoff


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference between two state dicts of the same keys."""
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)
