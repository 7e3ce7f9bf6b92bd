"""A Hub model's metadata, never its weights: config.json, the shard index and each safetensors header.

``resolve_device(model="org/name")`` for a model that is not in the local Hugging Face cache fetches
what the decision needs through huggingface_hub's own client (its session, token and error types;
``HF_ENDPOINT`` and ``revision=`` honoured): the model-info answer (the commit and the file list),
config.json, the shard index, and each safetensors header by two range requests (its 8-byte length,
then exactly that many bytes), so no byte of a tensor is read. Every request has a time limit and the
whole fetch a deadline. What was fetched is checked by the same functions as a local folder's files
(whichdevice.model.files) before it is kept, then kept in whichdevice's cache per endpoint, repo and
commit, and read back from there by the one reader below: nothing is fetched twice, and with
``HF_HUB_OFFLINE=1`` the cached metadata still answers.

Everything the Hub says is untrusted: a file list, a commit, a size, a header. Each failure (gated or
private repo, no such repo or revision, no safetensors weights, the network down or too slow,
offline mode) is a DeviceError that names the fix. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import tempfile
import time
from pathlib import Path

from whichdevice.core.errors import DamagedModelError, DeviceError
from whichdevice.core.frozen import frozen_record
from whichdevice.core.sizes import format_bytes
from whichdevice.core.untrusted import UntrustedFileError, read_untrusted
from whichdevice.model import hub_fetch
from whichdevice.model.files import ModelFiles, check_header, header_length, read_config, read_json, shard_names
from whichdevice.model.hub_fetch import COMMIT, INDEX, SINGLE, SIZES, NetworkError, fetch_files, model_info

__all__ = [
    "ENV_VARIABLES",
    "HubFetch",
    "hub_cache_root",
    "hub_offline",
    "read_hub_model",
]

ENV_VARIABLES = ("HF_HUB_OFFLINE", "HF_ENDPOINT", "XDG_CACHE_HOME")
# safetensors refuses a header over 100 MB (MAX_HEADER_SIZE).
_MAX_HEADER = 100_000_000
_MAX_REF = 10_000  # a ref whichdevice writes is about 100 bytes
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of HF_HUB_OFFLINE


@frozen_record
class HubFetch:
    """Where a Hub model's metadata came from: the repo and commit, what this call fetched (bytes per
    file; none when the cache answered) and the cache folder it is kept in."""

    repo: str
    revision: str
    commit: str
    endpoint: str
    folder: Path
    fetched: tuple[tuple[str, int], ...] = ()
    why_cached: str | None = None  # why the cache answered without fetching, None when fetched now

    @property
    def bytes_fetched(self) -> int:
        return sum(n for _, n in self.fetched)

    def describe(self) -> str:
        where = f"{self.endpoint}/{self.repo} at {self.commit[:12]} ({self.revision})"
        if self.why_cached is not None:
            return f"{where}: config.json and safetensors headers read from whichdevice's cache ({self.why_cached})"
        headers = [n for name, n in self.fetched if name.endswith(".safetensors")]
        files = [f"{name} ({format_bytes(n)})" for name, n in self.fetched if not name.endswith(".safetensors")]
        if headers:
            files.append(f"{len(headers)} safetensors header(s) by range request ({format_bytes(sum(headers))})")
        return (
            f"fetched {format_bytes(self.bytes_fetched)} of metadata from {where}, no weights: {', '.join(files)}; "
            f"kept in {self.folder}"
        )


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, at import (its constant) or now (the variable)."""
    from huggingface_hub import constants

    return bool(constants.is_offline_mode()) or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def _endpoint() -> str:
    # huggingface_hub reads HF_ENDPOINT once, at import; read it now, so a later setting is honoured.
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_cache_root() -> Path:
    """whichdevice's cache of Hub metadata (beside the CPU calibration's)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "whichdevice" / "hub"


def _repo_folder(endpoint: str, repo: str) -> Path:
    # One folder per endpoint: a mirror's or a test server's "org/name" is not the Hub's.
    digest = hashlib.sha256(endpoint.encode()).hexdigest()[:12]
    return hub_cache_root() / digest / ("models--" + repo.replace("/", "--"))


def read_hub_model(repo: str, revision: str | None) -> tuple[ModelFiles, HubFetch]:
    """The metadata of Hub model ``repo`` at ``revision`` (default "main"), read and checked: from
    whichdevice's cache, else fetched now (never a weight), checked, cached and read back."""
    revision = revision or "main"
    endpoint = _endpoint()
    repo_folder = _repo_folder(endpoint, repo)
    ref = repo_folder / "refs" / hashlib.sha256(revision.encode()).hexdigest()[:16]
    cached = _cached_commit(ref, revision)

    def from_cache(commit: str, why: str) -> tuple[ModelFiles, HubFetch]:
        fetch = HubFetch(repo, revision, commit, endpoint, _snapshot(repo_folder, commit), (), why)
        return _read_cached(repo_folder, fetch)

    if cached is not None and COMMIT.fullmatch(revision):
        return from_cache(cached, "a commit never changes")
    if hub_offline():
        if cached is not None:
            return from_cache(cached, "HF_HUB_OFFLINE is set, so the Hub was not asked whether the revision moved")
        raise DeviceError(
            f"model={repo!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set, so whichdevice "
            f"cannot fetch its config and safetensors headers: unset HF_HUB_OFFLINE (tens of KiB to a few MiB "
            f"of metadata, no weights), download it first (hf download {shlex.quote(repo)}), or pass a local path "
            "or a config (transformers.AutoConfig)"
        )
    # One deadline for every request of the fetch, model-info first (read at call time: tests shorten it).
    deadline = time.monotonic() + hub_fetch.DEADLINE_S
    try:
        commit, files = model_info(repo, revision, endpoint, deadline)
    except NetworkError as error:
        if cached is None:
            raise
        return from_cache(cached, f"the Hub could not be reached ({error.why}), as huggingface_hub falls back")
    if (_snapshot(repo_folder, commit) / SIZES).is_file():
        _write_ref(ref, revision, commit)
        return from_cache(commit, f"fetched before; the Hub says {revision} is still this commit")
    fetched = fetch_files(repo, commit, endpoint, files, deadline)
    folder = _snapshot(repo_folder, commit)
    _keep(folder, fetched)
    _write_ref(ref, revision, commit)
    counts = tuple((name, n) for name, (_, n) in fetched.items() if name != SIZES)
    return _read_cached(repo_folder, HubFetch(repo, revision, commit, endpoint, folder, counts))


# ---------------------------------------------------------------------------------------- reading


def _snapshot(repo_folder: Path, commit: str) -> Path:
    return repo_folder / "snapshots" / commit


def _cached_commit(ref: Path, revision: str) -> str | None:
    """The commit ``revision`` was when last fetched, if its metadata is complete in the cache."""
    try:  # a cache entry is untrusted: a FIFO or a huge file in its place is no ref
        content = json.loads(read_untrusted(ref, _MAX_REF, flags=getattr(os, "O_NOFOLLOW", 0)).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(content, dict) or content.get("revision") != revision:
        return None
    commit = content.get("commit")
    if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
        return None
    return commit if (ref.parent.parent / "snapshots" / commit / SIZES).is_file() else None


def _read_cached(repo_folder: Path, fetch: HubFetch) -> tuple[ModelFiles, HubFetch]:
    """The one reader of cached Hub metadata, fresh or old: the same checks as a local folder's files."""
    folder = fetch.folder
    if folder.is_symlink() or not folder.is_dir():
        raise DamagedModelError(f"{folder}: whichdevice's cache of {fetch.repo} is not a folder; delete {repo_folder}")
    config = read_config(folder)
    if config is None:
        raise DamagedModelError(
            f"{folder}: whichdevice's cache of {fetch.repo} lacks config.json; delete {repo_folder}"
        )
    sizes = read_json(folder / SIZES)
    if not isinstance(sizes, dict) or not all(type(v) is int and v >= 0 for v in sizes.values()):
        raise DamagedModelError(f"{folder / SIZES}: not a map of file -> bytes (corrupt); delete {repo_folder}")
    names = shard_names(read_json(folder / INDEX), folder / INDEX) if (folder / INDEX).exists() else [SINGLE]
    headers = []
    for name in names:
        where = folder / name
        if name not in sizes:
            raise DamagedModelError(f"{where}: whichdevice's cache has no size for it (corrupt); delete {repo_folder}")
        raw = _read_header_file(folder / _header_file(name), repo_folder)
        length = header_length(raw[:8], sizes[name], where)
        if len(raw) != 8 + length:
            raise DamagedModelError(
                f"{where}: the cached header is {len(raw)} bytes, not {8 + length}; delete {repo_folder}"
            )
        headers.append((where, check_header(raw[8:], sizes[name] - 8 - length, where)))
    return ModelFiles(folder, config, tuple(headers)), fetch


def _header_file(shard: str) -> str:
    return f"{shard}.header"


def _read_header_file(path: Path, repo_folder: Path) -> bytes:
    try:
        return read_untrusted(path, 8 + _MAX_HEADER, flags=getattr(os, "O_NOFOLLOW", 0))
    except (UntrustedFileError, FileNotFoundError) as exc:
        raise DamagedModelError(f"{path}: the cached header cannot be read ({exc}); delete {repo_folder}") from None


# ---------------------------------------------------------------------------------------- keeping


def _keep(folder: Path, fetched: dict[str, tuple[bytes, int]]) -> None:
    """Write the fetched metadata into ``folder`` whole or not at all (a temporary folder renamed)."""
    folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=folder.parent))
    try:
        for name, (content, _) in fetched.items():
            target = tmp / (name if name in ("config.json", INDEX, SIZES) else _header_file(name))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / SIZES).is_file():  # not another process's complete copy: ours goes in
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_ref(ref: Path, revision: str, commit: str) -> None:
    ref.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.NamedTemporaryFile("w", dir=ref.parent, delete=False, encoding="utf-8") as fh:
        json.dump({"revision": revision, "commit": commit}, fh)
    os.replace(fh.name, ref)
