"""``distrun shm ls | clean``: the shared-memory segments of this user on this machine.

A segment outlives its run only when the rank that created it is killed (kill -9, or its
launcher's death) before every rank has mapped it. The next shm group made on the machine
removes those; ``distrun shm clean`` removes them now. Torch-free.
"""

from __future__ import annotations

import os

import click

from distrun_shm.backend import creator_gone, remove_stale_segments, segments

__all__ = ["shm"]


def _size(name: str) -> int:
    try:
        return os.stat(os.path.join("/dev/shm", name)).st_size
    except OSError:
        return 0


@click.group("shm")
def shm() -> None:
    """The shm backend's shared-memory segments (/dev/shm) of this user."""


@shm.command("ls")
def ls_cmd() -> None:
    """List the segments: a live run's, or abandoned (their creator has ended)."""
    names = segments()
    if not names:
        click.echo("no shm segments in /dev/shm")
        return
    for name in names:
        state = "abandoned" if creator_gone(name) else "in use"
        click.echo(f"{name}  {_size(name) / 2**20:.1f} MiB  {state}")


@shm.command("clean")
def clean_cmd() -> None:
    """Remove the abandoned segments (a live run's are kept)."""
    sizes = {name: _size(name) for name in segments()}
    removed = remove_stale_segments()
    for name in removed:
        click.echo(f"removed {name}")
    freed = sum(sizes.get(name, 0) for name in removed) / 2**20
    click.echo(f"{len(removed)} abandoned segment{'s' if len(removed) != 1 else ''} removed "
               f"({freed:.1f} MiB); {len(segments())} in use")
