"""The entry points of the groups whichdevice reads, found without parsing every installed package's.

``importlib.metadata.entry_points(group=...)`` builds a Distribution for every package on ``sys.path``,
reads each one's name and parses each ``entry_points.txt``: 3.3-5 ms with the 100 packages of a
transformers install, and a fresh ``resolve_device()`` asked twice (torch's ``torch.backends`` plugins
before it imports torch, then the registry's ``whichdevice.backends``). Here each package's
``entry_points.txt`` is read as text, once for both groups; only a package whose file names one of them
is handed to ``importlib.metadata``, which builds the real :class:`~importlib.metadata.EntryPoint` objects
(``ep.dist`` included). The packages are taken as ``importlib.metadata`` takes them: ``sys.path`` in
order, the first folder of a normalized name winning. Where that search is not plain folders (a zip on
``sys.path``, a finder of distributions besides the path's own) the answer is ``importlib.metadata``'s.

The scan is kept while ``sys.path`` and its folders' modification times stay as they are: installing or
removing a package changes its folder's time, so a plugin installed from a notebook is found next time.
Each file is read as untrusted (:func:`~whichdevice.core.untrusted.read_untrusted`): a FIFO is not
waited on, nor is a file over a few MiB read.
"""

from __future__ import annotations

import os
import sys
import threading

from whichdevice.core.packages import normalized_name
from whichdevice.core.untrusted import read_untrusted

# typing costs several ms to import; mypy and ruff treat a module-level TYPE_CHECKING = False the same.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = ["AUTOLOAD_VARIABLE", "GROUPS", "TORCH_GROUP", "WHICHDEVICE_GROUP", "entry_points"]

# whichdevice's plugins register their Backend records here (hardware/registry.py).
WHICHDEVICE_GROUP = "whichdevice.backends"
# torch imports every entry point of this group on ``import torch`` unless AUTOLOAD_VARIABLE is set
# to anything but "1" (hardware/probes/plugins.py).
TORCH_GROUP = "torch.backends"
AUTOLOAD_VARIABLE = "TORCH_DEVICE_BACKEND_AUTOLOAD"
GROUPS = (WHICHDEVICE_GROUP, TORCH_GROUP)

# An entry_points.txt is a few KiB (the largest of this venv's 100 packages: setuptools', 2.4 KiB). One
# that is not a regular file (a FIFO would block the read) or is over this is not read: a package's
# folder is as untrusted as any file read back.
_MAX_BYTES = 4 * 1024**2

_lock = threading.Lock()
# (sys.path with each folder's modification time) -> group -> its entry points; the latest scan only.
_scanned: dict[tuple[tuple[str, int], ...], dict[str, tuple[EntryPoint, ...]]] = {}


def entry_points(group: str) -> tuple[EntryPoint, ...]:
    """``importlib.metadata.entry_points(group=group)``, for one of :data:`GROUPS`."""
    if group not in GROUPS or not _plain_search():
        from importlib import metadata

        return tuple(metadata.entry_points(group=group))
    key = tuple((folder, _mtime(folder)) for folder in _folders())
    with _lock:
        found = _scanned.get(key)
    if found is None:
        found = _scan(key)
        with _lock:
            _scanned.clear()
            _scanned[key] = found
    return found.get(group, ())


def _plain_search() -> bool:
    # importlib.metadata asks every finder on sys.meta_path; the path's own (PathFinder) reads the
    # folders below. A zip on sys.path is read by PathFinder too, but not by this module.
    from importlib.machinery import PathFinder

    finders = [f for f in sys.meta_path if hasattr(f, "find_distributions")]
    if any(f is not PathFinder for f in finders):
        return False
    return not any(os.path.isfile(entry or ".") for entry in sys.path)


def _folders() -> list[str]:
    # "" is the working directory, which a notebook may change between calls.
    return [os.path.abspath(entry or ".") for entry in sys.path]


def _mtime(folder: str) -> int:
    try:
        return os.stat(folder).st_mtime_ns
    except OSError:
        return -1


def _scan(key: tuple[tuple[str, int], ...]) -> dict[str, tuple[EntryPoint, ...]]:
    seen: set[str] = set()
    found: dict[str, list[EntryPoint]] = {}
    for folder, _ in key:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for item in names:
            stem, dot, suffix = item.rpartition(".")
            if not dot or suffix not in ("dist-info", "egg-info"):
                continue
            name = normalized_name(stem.partition("-")[0])
            if name in seen:  # an earlier folder's package of this name is the one imported
                continue
            seen.add(name)
            try:
                raw = read_untrusted(os.path.join(folder, item, "entry_points.txt"), _MAX_BYTES)
            except OSError:  # none (most packages), or not a regular file of at most _MAX_BYTES
                continue
            text = raw.decode("utf-8", errors="replace")
            wanted = [group for group in GROUPS if f"[{group}]" in text]
            if wanted:
                _add(found, os.path.join(folder, item), wanted)
    return {group: tuple(eps) for group, eps in found.items()}


def _add(found: dict[str, list[EntryPoint]], path: str, groups: list[str]) -> None:
    from importlib import metadata
    from pathlib import Path

    dist = metadata.PathDistribution(Path(path))
    for group in groups:
        found.setdefault(group, []).extend(dist.entry_points.select(group=group))
