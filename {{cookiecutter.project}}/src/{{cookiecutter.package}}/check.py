"""Check a training config before anything starts, and explain a bad one in one line.

    # exit 2 and one line, or 0
    python -m {{ cookiecutter.package }}.check trainer.max_steps=-1 nccl=pcie_safe

train runs the same check (config.compose.ConfigCheck) once Hydra has composed its config; the
launcher runs all of it but the optimizer's trial before torchrun starts.
"""

from __future__ import annotations

import argparse
import sys

from .config.compose import config_problem
from .core.exits import Exit
from .core.world import World


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        help="check for this many processes on one node: GPUs visible, a batch for each shard",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train")
    args = parser.parse_args()
    world = World.from_env()  # a plain `python -m`: one process
    if args.nproc_per_node is not None:
        if args.nproc_per_node < 1:
            print(
                f"error: --nproc-per-node={args.nproc_per_node}: must be at least 1",
                file=sys.stderr,
            )
            return Exit.CONFIG_ERROR
        world = World(size=args.nproc_per_node, local_size=args.nproc_per_node)
    problem = config_problem(args.overrides, world)
    if problem:
        print(f"config error: {problem}", file=sys.stderr)
        return Exit.CONFIG_ERROR
    print("config ok")
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
