"""Which resource limit a failure ran into (memory, open files, file size, disk), said as its fix.

Under ``ulimit -v``, ``ulimit -n`` or ``ulimit -f`` a command fails wherever the limit happens to be
reached: a ``MemoryError``, an ``OSError`` (EMFILE, ENFILE, EFBIG, ENOSPC, ENOMEM), or an
``ImportError`` from the dynamic loader that could not map a library ("failed to map segment"), or
torch's own allocator's ``RuntimeError`` ("can't allocate memory") once a tensor no longer fits.
None of these is a bug in whichdevice; :func:`limit_hit` turns them into one sentence that names
the limit, its current value where the process has one, and how to raise it.
"""

from __future__ import annotations

import contextlib
import errno
import os

try:  # read before a limit on open files can stop the import of its extension
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

__all__ = ["ResourceLimitError", "allocator_out_of_memory", "limit_hit", "say_limit"]


class ResourceLimitError(RuntimeError):
    """A failure that a resource limit caused (ulimit -v, -n, -f; a full disk); the message names it."""


# What the loader says when mmap fails for want of address space (glibc's dl-map-segments.h).
_LOADER_OUT_OF_MEMORY = ("failed to map segment", "cannot allocate memory", "cannot map zero-fill pages")


def _soft_limit(name: str) -> str:
    """The soft limit ``name`` (RLIMIT_AS, ...) as ulimit would print it; "" when it cannot be read."""
    try:
        soft = resource.getrlimit(getattr(resource, name))[0]
    except (AttributeError, OSError, ValueError):
        return ""
    if soft == resource.RLIM_INFINITY:
        return "unlimited"
    # ulimit -v counts KiB and ulimit -f blocks of 1024 bytes; ulimit -n counts descriptors.
    return str(soft // 1024) if name in ("RLIMIT_AS", "RLIMIT_FSIZE") else str(soft)


def _now(name: str) -> str:
    value = _soft_limit(name)
    return f", now {value}" if value else ""


# What torch's CPU allocator raises when malloc fails (c10/core/impl/alloc_cpu.cpp, a RuntimeError:
# "DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes. Error code 12 ...").
_ALLOCATOR_OUT_OF_MEMORY = "can't allocate memory"


def allocator_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's allocator failing for want of memory (a RuntimeError, not MemoryError)."""
    return isinstance(exc, RuntimeError) and _ALLOCATOR_OUT_OF_MEMORY in str(exc)


def limit_hit(exc: BaseException) -> str | None:
    """The sentence naming the resource limit ``exc`` ran into; None when it is no such failure."""
    if allocator_out_of_memory(exc):
        return (
            f"out of memory (torch's allocator: {_ALLOCATOR_OUT_OF_MEMORY}): the address-space limit "
            f"(ulimit -v{_now('RLIMIT_AS')}) or the machine's memory ran out; raise the limit "
            "(ulimit -v unlimited) or free memory"
        )
    if isinstance(exc, MemoryError) or (
        isinstance(exc, ImportError) and any(s in str(exc).lower() for s in _LOADER_OUT_OF_MEMORY)
    ):
        return (
            f"out of memory ({type(exc).__name__}): the address-space limit (ulimit -v{_now('RLIMIT_AS')}) or the "
            "machine's memory ran out while loading Python packages; torch alone maps about 1 GiB: raise the "
            "limit (ulimit -v unlimited) or free memory"
        )
    if not isinstance(exc, OSError):
        return None
    code = exc.errno
    if isinstance(exc, FileNotFoundError) and "No usable temporary directory" in str(exc):
        # tempfile tries each folder by writing a byte; under ulimit -f 0 every try fails (EFBIG).
        if _soft_limit("RLIMIT_FSIZE") not in ("", "unlimited"):
            code = errno.EFBIG
        else:
            return "no temporary folder is writable (tempfile found none): set TMPDIR to a writable folder"
    if code == errno.EMFILE:
        return (
            f"too many open files: the per-process limit (ulimit -n{_now('RLIMIT_NOFILE')}) is too "
            "low for Python, torch and the probes; raise it (ulimit -n 1024)"
        )
    if code == errno.ENFILE:
        return f"the system's table of open files is full ({exc.strerror}); close programs or raise fs.file-max"
    if code == errno.EFBIG:
        return (
            f"no file can grow past the file-size limit (ulimit -f{_now('RLIMIT_FSIZE')}); importing torch writes "
            "a temporary file, and whichdevice its calibration cache: raise it (ulimit -f unlimited)"
        )
    if code == errno.ENOSPC:
        return f"no space left on the disk ({exc.strerror}: {exc.filename or 'a temporary file'}); free some space"
    if code == errno.ENOMEM:
        return f"out of memory ({exc.strerror}; ulimit -v{_now('RLIMIT_AS')}): raise the limit or free memory"
    return None


def say_limit(exc: BaseException, prog: str) -> int:
    """Write ``prog: <the limit>`` to descriptor 2 and return exit code 1; re-raise ``exc`` when no
    limit caused it. For failures before the command's own streams exist (or after they are gone)."""
    limit = limit_hit(exc)
    if limit is None:
        raise exc
    with contextlib.suppress(OSError):
        os.write(2, f"{prog}: {limit}\n".encode("utf-8", "backslashreplace"))
    return 1
