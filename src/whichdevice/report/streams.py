"""The command's own streams: stdout holds only what the command prints, stderr only its one line.

While a command runs, whatever else writes to stdout or stderr (a vendor package's banner on import,
a library's warning, at the Python or the C level) goes to a capture that ``--debug`` shows
afterwards; the command's own text goes to copies of the original descriptors. A descriptor that was
closed (``whichdevice >&-``) is pointed at the null device first, so nothing opened later takes its
number; a reader that goes away (``| head -1``) or an encoding that cannot show a character
(``PYTHONIOENCODING=ascii``) loses that text, never the exit code.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

__all__ = ["Streams", "command_streams", "write"]


@dataclass
class Streams:
    """Where the command writes (``out``, ``err``) and what others wrote meanwhile (``captured``)."""

    out: TextIO
    err: TextIO
    captured: str = ""
    broken: set[int] = field(default_factory=set)  # id() of a stream whose reader went away


def write(streams: Streams, text: str, *, err: bool = False) -> None:
    """Write ``text`` to the command's stdout (or stderr); a lost reader or a closed stream is not an error."""
    stream = streams.err if err else streams.out
    if id(stream) in streams.broken:
        return
    try:
        try:
            stream.write(text)
        except UnicodeEncodeError:
            encoding = getattr(stream, "encoding", None) or "ascii"
            stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
        stream.flush()
    except (OSError, ValueError, AttributeError):
        # BrokenPipeError (| head), EBADF, a closed or missing stream: the text is lost, not the code.
        streams.broken.add(id(stream))


def _reopen_closed() -> None:
    # A descriptor closed by the shell (>&-, 2>&-) would be taken by the next file opened, and text
    # meant for it would land there (inside the JSON, in a vendor's log).
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def _copy_of(fd: int, like: Any) -> TextIO:
    encoding = getattr(like, "encoding", None) or "utf-8"
    raw = os.fdopen(os.dup(fd), "wb", buffering=0, closefd=True)
    return io.TextIOWrapper(raw, encoding=encoding, errors="backslashreplace", line_buffering=True, write_through=True)


@contextlib.contextmanager
def command_streams(descriptors: bool) -> Iterator[Streams]:
    """The command's streams for the block; everything else written meanwhile is captured.

    ``descriptors``: also capture at the descriptor level (C code, child processes), as the real
    command does; ``main(argv)`` called from Python only swaps ``sys.stdout`` and ``sys.stderr``.
    """
    saved_sys = (sys.stdout, sys.stderr)
    if not descriptors:
        sink = io.StringIO()
        streams = Streams(sys.stdout, sys.stderr)
        sys.stdout = sys.stderr = sink
        try:
            yield streams
        finally:
            sys.stdout, sys.stderr = saved_sys
            streams.captured = sink.getvalue()
        return
    try:
        # Under ulimit -f 0 no temporary file can be written (tempfile then finds "no usable
        # temporary directory"): the command still runs, capturing at the Python level only.
        capture = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below, after the yield
    except OSError:
        with command_streams(False) as streams:
            yield streams
        return
    _reopen_closed()
    streams = Streams(_copy_of(1, sys.stdout), _copy_of(2, sys.stderr))
    saved_fds = (os.dup(1), os.dup(2))
    try:
        for stream in saved_sys:
            with contextlib.suppress(Exception):
                stream.flush()  # type: ignore[union-attr]
        os.dup2(capture.fileno(), 1)
        os.dup2(capture.fileno(), 2)
        sink_text = io.TextIOWrapper(
            os.fdopen(os.dup(capture.fileno()), "wb", buffering=0), encoding="utf-8", errors="backslashreplace"
        )
        sys.stdout = sys.stderr = sink_text
        try:
            yield streams
        finally:
            with contextlib.suppress(Exception):
                sink_text.flush()
            sys.stdout, sys.stderr = saved_sys
            with contextlib.suppress(Exception):
                sink_text.close()
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            capture.seek(0)
            streams.captured = capture.read().decode("utf-8", "replace")
    finally:
        for fd in saved_fds:
            os.close(fd)
        capture.close()


def close(streams: Streams) -> None:
    """Flush and close the command's copies (after ``command_streams``), quietly."""
    for stream in (streams.out, streams.err):
        with contextlib.suppress(Exception):
            stream.flush()
        with contextlib.suppress(Exception):
            stream.close()
