"""Install the bundled Snakemake profiles where `snakemake --profile NAME` looks for them.

Snakemake resolves a bare profile name only in ./NAME and ~/.config/snakemake/NAME (a path such as
profiles/slurm works from a checkout), so cluster users copy the profile once and then run
`snakemake --profile slurm train` from anywhere.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dflop.errors import UserError

BUNDLED_PROFILES = Path(__file__).resolve().parents[1] / "profiles"


DEFAULT_PARENT = Path.home() / ".config" / "snakemake"


def profile_argument(dest: Path, cwd: Path | None = None) -> str:
    """What to pass to `snakemake --profile` for the profile installed at `dest`, from `cwd`.

    The bare name only where Snakemake looks for one (the default parent, or `cwd` itself); else
    the path, relative to `cwd` when it lies below it.
    """
    dest, cwd = Path(dest).resolve(), (Path.cwd() if cwd is None else Path(cwd)).resolve()
    if dest.parent in (DEFAULT_PARENT.resolve(), cwd):
        return dest.name
    return os.path.relpath(dest, cwd) if dest.is_relative_to(cwd) else str(dest)


def install_profile(name: str, dest_parent: Path | None = None, *, force: bool = False) -> Path:
    """Copy profiles/<name> to <dest_parent>/<name> (default ~/.config/snakemake); returns the copy."""
    source = BUNDLED_PROFILES / name
    if not (source / "config.yaml").exists():
        raise UserError(f"profile {name!r} not found at {source} (install dflop from a checkout: pip install -e .)")
    parent = Path(dest_parent) if dest_parent is not None else DEFAULT_PARENT
    dest = parent / name
    if dest.exists() and not force:
        raise UserError(f"{dest} already exists; edit it, or pass --force to overwrite it")
    parent.mkdir(parents=True, exist_ok=True)
    # Copy next to the destination, then rename, so an interrupted copy leaves no half profile.
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=parent))
    try:
        shutil.copytree(source, staging / name)
        if dest.exists():
            shutil.rmtree(dest)
        (staging / name).rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest
