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

from whichdevice.core.untrusted import UntrustedFileError, read_untrusted

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
    link (O_NOFOLLOW), never a pipe or device, read by core.untrusted's reader (a stat first, opened
    without blocking, capped in size and time). Raises FileNotFoundError when there is none,
    NotOwnedError saying why it is not to be trusted."""
    problem = not_owned(path)
    if problem is not None:
        raise NotOwnedError(problem)
    # The owner is checked again on the open descriptor: a file swapped in between the check and the open.
    try:
        return read_untrusted(
            path,
            _MAX_BYTES,
            flags=getattr(os, "O_NOFOLLOW", 0),
            check=lambda info: _problem(path, info, "cache file"),
        )
    except UntrustedFileError as error:  # a link put there since the check fails O_NOFOLLOW here
        raise NotOwnedError(str(error)) from None
