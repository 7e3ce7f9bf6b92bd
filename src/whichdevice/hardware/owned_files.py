"""whichdevice's own cache files, read and written only where no one else could have put them.

The calibration cache lives under ``$XDG_CACHE_HOME`` (or ``WHICHDEVICE_CALIBRATION``), which on a
cluster is often a shared or world-writable folder. A file there that another user owns, or a
symbolic link (which could point a write at any file the user can change), is not whichdevice's
own: it is not read as trusted and nothing is written through it. Nothing here imports torch.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["NotOwnedError", "not_owned", "read_owned"]

# Far more than any cache file whichdevice writes (about 2 KB): a larger one is not ours.
_MAX_BYTES = 1_000_000


class NotOwnedError(OSError):
    """The file (or its folder) is not whichdevice's own to trust; the text says why."""


def _problem(path: Path, info: os.stat_result, what: str) -> str | None:
    if stat.S_ISLNK(info.st_mode):
        return f"the {what} {path} is a symbolic link"
    uid = os.getuid() if hasattr(os, "getuid") else None
    if uid is not None and info.st_uid != uid:
        return f"the {what} {path} belongs to user id {info.st_uid}, not to you (user id {uid})"
    return None


def not_owned(path: Path) -> str | None:
    """Why ``path`` (a file, existing or not) or its folder is not the user's own; None when both are."""
    try:
        folder = os.lstat(path.parent)
    except OSError:
        return None  # no folder yet: it will be created, and be the user's
    problem = _problem(path.parent, folder, "cache folder")
    if problem is not None:
        return problem
    try:
        return _problem(path, os.lstat(path), "cache file")
    except OSError:
        return None  # no file yet


def read_owned(path: Path) -> bytes:
    """The bytes of ``path``: a regular file of the user's own, in a folder of the user's own, never a
    link (O_NOFOLLOW), never a pipe or device (opened without blocking, then checked). Raises
    FileNotFoundError when there is none, NotOwnedError saying why it is not to be trusted."""
    problem = not_owned(path)
    if problem is not None:
        raise NotOwnedError(problem)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == 40:  # ELOOP: O_NOFOLLOW met a link put there since the check
            raise NotOwnedError(f"the cache file {path} is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise NotOwnedError(f"the cache file {path} is not a regular file")
        problem = _problem(path, info, "cache file")
        if problem is not None:
            raise NotOwnedError(problem)
        data = fh.read(_MAX_BYTES + 1)
    if len(data) > _MAX_BYTES:
        raise NotOwnedError(f"the cache file {path} is over {_MAX_BYTES} bytes, far more than whichdevice writes")
    return data
