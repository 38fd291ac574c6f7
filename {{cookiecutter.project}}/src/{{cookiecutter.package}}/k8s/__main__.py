"""python -m {{ cookiecutter.package }}.k8s [--check] [--out DIR] [KEY=VALUE ...]: see the
package's docstring."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .. import PACKAGE, k8s
from ..core.exits import Exit
from . import persist, render, sync
from .pods import nccl_env
from .render import deploy_and_profile
from .sync import project_root


def outside_project(out: Path) -> str | None:
    """Why `out` is not a folder to write manifests to without --force, or None."""
    root = project_root(Path.cwd())
    if out.resolve().is_relative_to(root):
        return None
    return f"--out {out}: outside this project ({root}); pass --force to write there"


def default_out() -> Path:
    """k8s/ beside the project's configs/, from any folder in the project (make k8s-apply reads
    it there); in a folder of no such project, k8s/ here."""
    root = project_root(Path.cwd())
    return (
        Path(os.path.relpath(root / "k8s"))
        if (root / "configs" / "train.yaml").is_file()
        else Path("k8s")
    )


def main() -> int:
    from ..config import compose as check

    parser = argparse.ArgumentParser(
        description=k8s.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, help="the folder to write (default: the project's k8s/)"
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--force", action="store_true", help="write --out outside the project")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train")
    args = parser.parse_args()
    given = args.out is not None
    args.out = args.out if given else default_out()
    refused = None if args.check or args.force else outside_project(args.out)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return Exit.CONFIG_ERROR
    command = f"python -m {PACKAGE}.k8s" + (f" --out {args.out}" if given else "")
    if args.check and args.overrides:
        print(
            f"error: --check compares k8s/ with configs/ as they are: run {command} "
            f"{' '.join(args.overrides)} to write the overrides first",
            file=sys.stderr,
        )
        return Exit.CONFIG_ERROR
    # A project's own configs/ when run in it (the files an override is written to), else the
    # installed package's.
    source = project_root(Path.cwd()) / "configs"
    folder = source if (source / "train.yaml").is_file() else None
    # From reading configs/ to writing k8s/: another render at the same time would leave k8s/
    # without this one's overrides, or configs/ without its.
    with sync.locked(folder):
        # deploy_errors() included: exit 2, one line. The pods' GPUs are not this machine's.
        try:
            cfg = check.compose_and_check(args.overrides, folder, this_node=False)
        except check.CONFIG_ERRORS as err:
            return check.refused(err)
        deploy, profile = deploy_and_profile(cfg)
        rendered = render.manifests(deploy, nccl_env(profile))
        if args.check:
            found = sync.differences(rendered, args.out)
            if not found:
                print(f"{args.out}/ matches configs/ ({', '.join(rendered)})")
                return Exit.OK
            sys.stdout.writelines(sync.unified_diff(rendered, args.out))
            print(
                f"{args.out}/ differs from configs/ ({len(found)} file(s)); "
                f"{command} writes it again",
                file=sys.stderr,
            )
            return Exit.FAILED
        if args.overrides:
            if folder is None:
                print(
                    "error: no configs/ here to write the overrides to: "
                    f"run {command} in the project",
                    file=sys.stderr,
                )
                return Exit.CONFIG_ERROR
            composed = {"deploy": deploy, "nccl": profile, "profile": cfg.nccl.profile}
            try:
                written = persist.persist(args.overrides, composed, folder)
            except (ValueError, OSError) as err:
                print(f"error: {err}; nothing was written", file=sys.stderr)
                return Exit.CONFIG_ERROR
            for line in written:
                print(f"wrote {line}")
        try:
            sync.write(rendered, args.out)
        except OSError as err:
            print(
                f"error: {err}; {args.out}/ is as it was: {command} writes it again",
                file=sys.stderr,
            )
            return Exit.FAILED
    print(f"wrote {', '.join(str(args.out / file) for file in rendered)}")
    for note in render.notes(deploy):
        print(note)
    return Exit.OK


def run() -> int:
    try:
        return main()
    except KeyboardInterrupt:  # configs/ and k8s/ are each replaced at once: old or new, never half
        print(
            f"python -m {PACKAGE}.k8s: stopped by SIGINT; "
            f"python -m {PACKAGE}.k8s --check says whether k8s/ matches configs/",
            file=sys.stderr,
        )
        return Exit.INTERRUPTED


if __name__ == "__main__":
    sys.exit(run())
