"""Installed package versions, read from metadata files without importing the package, and compared.

Every module asks here, so there is one place to cache, one place to clear after ``pip install`` in
a notebook (``probing.clear_cache``), and one place that ``testing.simulate(packages=...)`` feeds.

The metadata is read straight from the ``*.dist-info``/``*.egg-info`` folders on ``sys.path``
(what ``importlib.metadata`` searches too): importing ``importlib.metadata`` and the e-mail parser
it reads headers with costs about 35 ms, more than the rest of a fresh resolution.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import lru_cache

__all__ = [
    "MIN_TORCH",
    "MIN_TRANSFORMERS",
    "cache_clear",
    "generation",
    "known_versions",
    "normalized_name",
    "package_version",
    "pip_install",
    "requirement_on",
    "simulated_packages",
    "stack_problems",
    "torch_problem",
    "transformers_problem",
    "version_at_least",
    "version_before",
]

_lock = threading.Lock()
_cache: dict[str, str | None] = {}
# a sys.path folder -> its metadata folders by normalized distribution name (_distributions_in)
_folders: dict[str, dict[str, list[str]]] = {}
# simulate(packages={...}) pushes a mapping; the innermost one answers for the names it holds.
_simulated: list[Mapping[str, str | None]] = []
# Bumped whenever the answers may change, so memoised resolutions built on old answers are not reused.
_generation = [0]


def generation() -> int:
    """A number that changes whenever ``package_version`` may answer differently."""
    return _generation[0]


def normalized_name(name: str) -> str:
    # PEP 503 names: "torch-npu", "torch_npu" and "Torch.NPU" are one distribution.
    return re.sub(r"[-_.]+", "_", name).lower()


def _read_version(folder: str) -> str | None:
    for meta in ("METADATA", "PKG-INFO"):
        try:
            with open(os.path.join(folder, meta), encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if line.startswith("Version:"):
                        return line.partition(":")[2].strip() or None
                    if not line.strip():
                        break  # end of the header block
        except OSError:
            continue
    return None


def _find_version(name: str) -> str | None:
    wanted = normalized_name(name)
    for entry in sys.path:
        folder = entry or "."
        if os.path.isfile(folder):
            # A zip or egg on the path: only importlib.metadata reads those.
            found = _metadata_version(name)
            if found is not None:
                return found
            continue
        for meta in _distributions_in(folder).get(wanted, ()):
            version = _read_version(meta)
            if version is not None:
                return version
    return None


def _distributions_in(folder: str) -> dict[str, list[str]]:
    """The metadata folders in ``folder`` by normalized distribution name, listed once per process
    (until ``cache_clear``): a fresh resolution asks for a dozen names, and listing and normalizing
    site-packages for each of them took 4-5 ms of it. Keyed by the absolute path: sys.path's "" is
    the working directory, which a notebook may change between calls."""
    folder = os.path.abspath(folder)
    with _lock:
        index = _folders.get(folder)
    if index is not None:
        return index
    index = {}
    try:
        names = os.listdir(folder)
    except OSError:
        names = []
    for item in names:
        stem, dot, suffix = item.rpartition(".")
        if dot and suffix in ("dist-info", "egg-info"):
            index.setdefault(normalized_name(stem.split("-", 1)[0]), []).append(os.path.join(folder, item))
    with _lock:
        _folders[folder] = index
    return index


def _metadata_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def package_version(name: str) -> str | None:
    """Installed version of distribution ``name``, or None; cached per process (see ``cache_clear``)."""
    for layer in reversed(_simulated):
        if name in layer:
            return layer[name]
    with _lock:
        if name in _cache:
            return _cache[name]
    version = _find_version(name)
    with _lock:
        _cache[name] = version
    return version


def known_versions() -> dict[str, str | None]:
    """Every version ``package_version`` has answered so far in this process, simulated ones
    included (the innermost simulation's win): what a report records for its replay."""
    with _lock:
        out = dict(_cache)
    for layer in _simulated:
        out.update(layer)
    return out


def requirement_on(name: str, dependency: str) -> str | None:
    """The version specifier installed ``name`` declares for ``dependency`` ("==2.13.0.*"), or None.

    From the Requires-Dist lines of its metadata (markers ignored); a simulated ``name`` has none.
    """
    if any(name in layer for layer in _simulated) or package_version(name) is None:
        return None
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement

    try:
        lines = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return None
    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if normalized_name(req.name) == normalized_name(dependency) and req.marker is None and str(req.specifier):
            return str(req.specifier)
    return None


def cache_clear() -> None:
    """Forget every version read so far: a package installed since shows up on the next ask."""
    with _lock:
        _cache.clear()
        _folders.clear()
        _generation[0] += 1
    transformers_problem.cache_clear()
    torch_problem.cache_clear()


# kept for callers of the functools-style name (probes.package_version.cache_clear())
package_version.cache_clear = cache_clear  # type: ignore[attr-defined]


@contextmanager
def simulated_packages(versions: Mapping[str, str | None]) -> Iterator[None]:
    """Answer ``package_version`` from ``versions`` (None: not installed) inside the block."""
    _simulated.append(dict(versions))
    _generation[0] += 1
    transformers_problem.cache_clear()
    torch_problem.cache_clear()
    try:
        yield
    finally:
        _simulated.pop()
        _generation[0] += 1
        transformers_problem.cache_clear()
    torch_problem.cache_clear()


_RELEASE = re.compile(r"\d+(?:\.\d+)*")


def _compare(text: str, minimum: str) -> int:
    # Plain releases (5.25.0 against 4.57) compare as numbers, padded (4.57 == 4.57.0) as PEP 440
    # does, without importing packaging (2-3 ms of a fresh resolution). Anything else goes to
    # packaging, which orders pre-releases before the release (2.6.0rc1 < 2.6.0) and a local build
    # after its release (2.13.0+cu130 > 2.13.0); a string it cannot parse compares as its leading numbers.
    if _RELEASE.fullmatch(text) and _RELEASE.fullmatch(minimum):
        a_rel, b_rel = [int(p) for p in text.split(".")], [int(p) for p in minimum.split(".")]
        width = max(len(a_rel), len(b_rel))
        a_rel += [0] * (width - len(a_rel))
        b_rel += [0] * (width - len(b_rel))
        return (a_rel > b_rel) - (a_rel < b_rel)
    from packaging.version import InvalidVersion, Version

    try:
        a, b = Version(text), Version(minimum)
    except InvalidVersion:
        a_num = tuple(int(p) for p in re.findall(r"\d+", text)[:3])
        b_num = tuple(int(p) for p in re.findall(r"\d+", minimum)[:3])
        return (a_num > b_num) - (a_num < b_num)
    return (a > b) - (a < b)


def version_at_least(text: str, minimum: str) -> bool:
    """True when version ``text`` is ``minimum`` or newer (a pre-release of ``minimum`` is older)."""
    return _compare(text, minimum) >= 0


def version_before(text: str, limit: str) -> bool:
    """True when version ``text`` is older than ``limit``."""
    return _compare(text, limit) < 0


# The oldest transformers and torch whichdevice supports (pyproject's requirements, compared in
# tests/core/test_packages.py; a nox session tests the transformers floor).
MIN_TRANSFORMERS = "4.57"
MIN_TORCH = "2.6"


def _floor_problem(name: str, minimum: str, *, release_only: bool = False) -> str | None:
    fix = f"pip install '{name}>={minimum}'"
    version = package_version(name)
    if version is None:
        return f"{name} is not installed: {fix}"
    release = re.match(r"\d+(\.\d+)*", version) if release_only else None
    if version_before(release.group() if release else version, minimum):
        return f"{name} {version} is older than whichdevice supports ({minimum} or newer): {fix}"
    return None


@lru_cache(maxsize=1)
def transformers_problem() -> str | None:
    """What is wrong with the installed transformers for whichdevice (missing, too old), or None.

    Read from package metadata once per process (an import already made cannot change), so
    transformers is not imported to find out; ``transformers_problem.cache_clear()`` reads again.
    """
    return _floor_problem("transformers", MIN_TRANSFORMERS)


@lru_cache(maxsize=1)
def torch_problem() -> str | None:
    """What is wrong with the installed torch for whichdevice (missing, older than MIN_TORCH), or None: read
    as transformers' is, from metadata. Its release decides: a CUDA or ROCm build's local version
    ("2.13.0+cu128") and the pre-release builds NVIDIA's containers ship ("2.6.0a0+ecf3bae") are that release."""
    return _floor_problem("torch", MIN_TORCH, release_only=True)


def stack_problems() -> list[str]:
    """The floors the installed stack misses, torch's first (transformers imports it)."""
    return [p for p in (torch_problem(), transformers_problem()) if p is not None]


def pip_install(*requirements: str) -> str:
    """``pip install 'torch>=2.1'``: the command, each requirement quoted for a shell, since a version
    may come from a replayed report or a package's metadata and a pasted command must do only that."""
    import shlex  # not on a resolve's path: imported when a command is written

    return shlex.join(["pip", "install", *requirements])
