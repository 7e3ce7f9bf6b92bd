"""Files named by the environment or a config, read as untrusted: regular files only, capped in size and time.

A variable (``ACCELERATE_DEEPSPEED_CONFIG_FILE``, ``WHICHDEVICE_CALIBRATION``, ...) or a report can name
any path: a FIFO nobody writes blocks ``open()`` and ``read()`` forever, ``/dev/zero`` never ends and
reports a size of 0, a folder or a socket is no file. So every such file is read the one way here:
``os.stat`` before the open, the open without blocking (a FIFO opens at once then), the kind and size
checked again on the open descriptor (the path may have changed between the two), at most ``max_bytes``
read, and the read given up after ``max_seconds`` (a file system that trickles). What is wrong is said
as an :class:`UntrustedFileError`, whose text the caller puts in its trace or error.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable

__all__ = ["MAX_SECONDS", "UntrustedFileError", "read_untrusted"]


def _quoted(value: str, limit: int = 300) -> str:
    """``repr(value)``, which escapes control characters, cut to about ``limit`` characters. (Not
    core.errors' ``shown``: importing it here would lengthen every import chain through this module.)"""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(value)} characters)"


# A config, a report or a cache entry is read in well under a second from any disk; past this the
# file system is stalled (a hung network mount) and the variables alone decide.
MAX_SECONDS = 5.0
_CHUNK = 1 << 16


class UntrustedFileError(OSError):
    """A file named by the environment or a config that is not read: not a regular file, over its
    size cap, too slow, or unreadable. The text names the path (quoted, escaped) and what it is;
    ``problem`` is what it is alone, for a caller that names the path its own way."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{_quoted(where)} {problem}" if where else problem)
        self.problem = problem


def _kind(mode: int) -> str | None:
    """What a stat mode is when it is not a regular file; None when it is one."""
    if stat.S_ISREG(mode):
        return None
    for check, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if check(mode):
            return name
    return "not a regular file"


def read_untrusted(
    path: str | os.PathLike[str],
    max_bytes: int,
    *,
    max_seconds: float = MAX_SECONDS,
    flags: int = 0,
    check: Callable[[os.stat_result], str | None] | None = None,
) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes``, read within ``max_seconds``.

    ``flags`` adds to the open's flags (``O_NOFOLLOW`` for a file that must not be a link); ``check``
    is asked of the open descriptor's stat (its owner, ...) and what it returns stops the read. Raises
    FileNotFoundError when there is none (the caller decides whether that is a problem), and
    UntrustedFileError, naming the path, for anything else that stops the read.
    """
    where = os.fspath(path)
    try:
        kind = _kind(os.stat(where).st_mode)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UntrustedFileError(where, f"cannot be read ({exc.strerror or exc})") from None
    if kind is not None:  # said before the open: opening a device can have effects of its own
        raise UntrustedFileError(where, f"is {kind}, not a file; whichdevice reads only regular files")
    try:
        fd = os.open(where, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UntrustedFileError(where, f"cannot be opened ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        kind = _kind(info.st_mode)
        if kind is not None:  # swapped for something else between the stat and the open
            raise UntrustedFileError(where, f"is {kind}, not a file; whichdevice reads only regular files")
        problem = check(info) if check is not None else None
        if problem is not None:
            raise UntrustedFileError("", problem)
        if info.st_size > max_bytes:
            raise UntrustedFileError(where, f"is {info.st_size} bytes, over the {max_bytes} this file can be")
        return _read_capped(fd, where, max_bytes, time.monotonic() + max_seconds, max_seconds)
    except UntrustedFileError:
        raise
    except OSError as exc:
        raise UntrustedFileError(where, f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def _read_capped(fd: int, where: str, max_bytes: int, deadline: float, max_seconds: float) -> bytes:
    # The size is read again as bytes come: a file that grows while it is read is still cut at the cap.
    out = bytearray()
    while True:
        chunk = os.read(fd, min(_CHUNK, max_bytes + 1 - len(out)))
        if not chunk:
            return bytes(out)
        out += chunk
        if len(out) > max_bytes:
            raise UntrustedFileError(where, f"is over the {max_bytes} bytes this file can be")
        if time.monotonic() > deadline:
            raise UntrustedFileError(where, f"took over {max_seconds:g} s to read; its file system is stalled")
