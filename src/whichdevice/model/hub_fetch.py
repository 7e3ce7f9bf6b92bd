"""Fetching a Hub model's metadata over HTTP with huggingface_hub's own client, never a weight.

The model-info answer (the commit and the file list), config.json and the shard index by bounded
GETs, and each safetensors header by two range requests (its 8-byte length, then exactly that many
bytes), read as streams and cut off, so a server that ignores Range still sends no tensor byte here.
Each request has a time limit and the whole fetch a deadline. The Hub's and the transport's errors
become DeviceErrors that name the fix; whichdevice.model.hub checks and keeps what comes back.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from whichdevice.core.errors import DamagedModelError, DeviceError, printable
from whichdevice.model.files import header_length, shard_names

__all__ = ["COMMIT", "DEADLINE_S", "INDEX", "SINGLE", "SIZES", "TIMEOUT_S", "NetworkError", "fetch_files", "model_info"]

# Seconds each request may wait to connect or between bytes (huggingface_hub's own default is 10),
# and for the whole fetch: a Hub that trickles cannot hold resolve_device() for long.
TIMEOUT_S = 10.0
DEADLINE_S = 120.0
# A config.json or a shard index is kilobytes to a few megabytes; past this it is not one.
_MAX_JSON = 20_000_000
COMMIT = re.compile(r"[0-9a-f]{40}")
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
SIZES = "whichdevice-sizes.json"  # shard -> the whole file's bytes, as the Hub stated them


def model_info(repo: str, revision: str, endpoint: str, deadline: float | None = None) -> tuple[str, set[str]]:
    """(the commit ``revision`` is, the repo's file names) from the Hub's model-info answer, read as a
    stream under ``deadline`` (time.monotonic(); default: DEADLINE_S from now), as huggingface_hub's
    ``HfApi.model_info`` asks it (hf_api.py, ``model_info``: GET /api/models/REPO/revision/REV): its
    ``timeout`` bounds each read only, so a server that sends a byte every few seconds would hold it forever."""
    from urllib.parse import quote

    deadline = time.monotonic() + DEADLINE_S if deadline is None else deadline
    url = f"{endpoint}/api/models/{repo}/revision/{quote(revision, safe='')}"
    with _hub_errors(repo, revision, endpoint):
        body, _ = _stream(url, _hub_headers(), _MAX_JSON + 1, deadline, endpoint)
    try:
        info = json.loads(body.decode("utf-8")) if len(body) <= _MAX_JSON else None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        info = None
    if not isinstance(info, dict):
        raise _network(endpoint, f"its model-info answer for {repo!r} is not a JSON object")
    commit = info.get("sha")
    if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
        raise DeviceError(
            f"{endpoint} answered for {repo!r} at {revision!r} without a commit hash ({printable(repr(commit))[:60]})"
        )
    siblings = info.get("siblings")
    siblings = siblings if isinstance(siblings, list) else []
    names = {s["rfilename"] for s in siblings if isinstance(s, dict) and isinstance(s.get("rfilename"), str)}
    return commit, names


def _hub_headers() -> dict[str, str]:
    """The token huggingface_hub would send (``get_token()``, unless HF_HUB_DISABLE_IMPLICIT_TOKEN), and a
    user agent. Not ``build_hf_headers``: in huggingface_hub 2.4 its user agent fetches
    ``{endpoint}/api/agent-harnesses`` once per process (utils/_detect_agent.py, ``_fetch_registry``) with
    a per-read timeout only, a request outside the fetch's deadline that a trickling endpoint holds."""
    from huggingface_hub import constants, get_token

    from whichdevice.core.packages import package_version

    agent = f"whichdevice/{package_version('whichdevice')}; hf_hub/{package_version('huggingface_hub')}"
    token = None if constants.HF_HUB_DISABLE_IMPLICIT_TOKEN else get_token()
    return {"user-agent": agent, **({"authorization": f"Bearer {token}"} if token else {})}


def fetch_files(
    repo: str, commit: str, endpoint: str, files: set[str], deadline: float
) -> dict[str, tuple[bytes, int]]:
    """Each metadata file's bytes and the bytes fetched for it (a header: its 8-byte length + the JSON)."""
    quoted = shlex.quote(repo)
    if INDEX not in files and SINGLE not in files:
        kind = _weights_kind(files)
        raise DeviceError(
            f"model={repo!r} has {kind} on the Hub and no model.safetensors, so whichdevice cannot read "
            "the weights' sizes without downloading them: pass a config (transformers.AutoConfig.from_pretrained"
            f"({repo!r})) to size it from, or download it first (hf download {quoted}) and pass the folder"
        )
    if "config.json" not in files:
        raise DeviceError(
            f"model={repo!r} has no config.json on the Hub ({_some(files)}), so from_pretrained cannot load it "
            "as it is: pass a config (transformers.AutoConfig) or a local folder with one"
        )
    get = _Getter(repo, commit, endpoint, deadline)
    out: dict[str, tuple[bytes, int]] = {}
    config = get.whole("config.json")
    out["config.json"] = (config, len(config))
    shards = [SINGLE]
    if INDEX in files:
        index = get.whole(INDEX)
        out[INDEX] = (index, len(index))
        try:
            content = json.loads(index.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise DamagedModelError(f"{get.url(INDEX)}: not valid JSON (corrupt); pass a config instead") from None
        shards = shard_names(content, Path(INDEX))
        missing = [s for s in shards if s not in files]
        if missing:
            raise DamagedModelError(
                f"{get.url(INDEX)} names {missing[0]!r}, which the repo at {commit[:12]} does not have; "
                "pass another revision= or a config"
            )
    sizes = {}
    # Eight at a time, as huggingface_hub's get_safetensors_metadata does: a 70B model has 30 shards.
    with ThreadPoolExecutor(max_workers=min(8, len(shards))) as pool:
        for shard, (raw, size) in zip(shards, pool.map(get.header, shards), strict=True):
            out[shard] = (raw, len(raw))
            sizes[shard] = size
    out[SIZES] = (json.dumps(sizes).encode(), 0)  # written by whichdevice, not fetched
    return out


def _weights_kind(files: set[str]) -> str:
    kinds = [
        (".bin", "only PyTorch .bin weights"),
        (".gguf", "only GGUF weights (from_pretrained reads them only with gguf_file=, dequantized)"),
        (".safetensors", "safetensors files under other names than model.safetensors"),
    ]
    for suffix, kind in kinds:
        if any(f.endswith(suffix) for f in files):
            return kind
    return "no weights"


def _some(files: set[str]) -> str:
    shown = sorted(files)[:5]
    return "its files: " + ", ".join(shown) + (", ..." if len(files) > 5 else "") if shown else "no files"


class _Getter:
    """Range and bounded GETs of one repo's files at one commit, with the Hub's errors named."""

    def __init__(self, repo: str, commit: str, endpoint: str, deadline: float) -> None:
        self.repo, self.commit, self.endpoint, self.deadline = repo, commit, endpoint, deadline
        self.headers = _hub_headers()

    def url(self, name: str) -> str:
        from huggingface_hub import hf_hub_url

        return str(hf_hub_url(self.repo, name, revision=self.commit, endpoint=self.endpoint))

    def whole(self, name: str) -> bytes:
        body, _ = self._get(name, None, _MAX_JSON + 1)
        if len(body) > _MAX_JSON:
            raise DamagedModelError(f"{self.url(name)}: over {_MAX_JSON} bytes, not a config or an index")
        return body

    def header(self, shard: str) -> tuple[bytes, int]:
        """(the 8-byte length and the header JSON, the file's whole size) by two range requests."""
        prefix, size = self._get(shard, (0, 7), 8)
        where = Path(self.url(shard))
        try:
            length = header_length(prefix, size, where)
        except DamagedModelError as error:
            raise DamagedModelError(f"{self.url(shard)}: {_problem(error)}") from None
        raw, _ = self._get(shard, (8, 8 + length - 1), length) if length else (b"", size)
        if len(raw) != length:
            raise DamagedModelError(f"{self.url(shard)}: the Hub sent {len(raw)} header bytes of {length}")
        return prefix[:8] + raw, size

    def _get(self, name: str, span: tuple[int, int] | None, most: int) -> tuple[bytes, int]:
        """At most ``most`` bytes of ``name`` (of bytes ``span`` only), and the whole file's size:
        read as a stream and cut off, so a server that ignores Range never sends a weight here."""
        headers = dict(self.headers)
        if span is not None:
            headers["Range"] = f"bytes={span[0]}-{span[1]}"
        with _hub_errors(self.repo, self.commit, self.endpoint):
            return _stream(self.url(name), headers, most, self.deadline, self.endpoint, span)


def _stream(
    url: str, headers: dict[str, str], most: int, deadline: float, endpoint: str, span: tuple[int, int] | None = None
) -> tuple[bytes, int]:
    """One GET under the fetch's deadline: each read waits at most TIMEOUT_S (and no longer than the time
    left), and the body is given up once the deadline passes, however slowly its bytes still come."""
    from huggingface_hub import get_session, hf_raise_for_status

    left = deadline - time.monotonic()
    if left <= 0:
        raise _network(endpoint, f"the fetch took over {DEADLINE_S:g} s")
    with get_session().stream("GET", url, headers=headers, timeout=min(TIMEOUT_S, left)) as response:
        hf_raise_for_status(response)
        # A server that ignores Range answers 200 from byte 0: read up to the span's end, no further.
        skip = span[0] if span is not None and response.status_code == 200 else 0
        body = _bounded(response.iter_bytes(), skip + most, deadline, endpoint)
        size = _whole_size(response.status_code, response.headers, len(body))
    return body[skip:], size


def _bounded(chunks: Iterator[bytes], most: int, deadline: float, endpoint: str) -> bytes:
    out = bytearray()
    for chunk in chunks:
        out += chunk
        if len(out) >= most:
            return bytes(out[:most])
        if time.monotonic() > deadline:
            raise _network(endpoint, f"the fetch took over {DEADLINE_S:g} s")
    return bytes(out)


def _whole_size(status: int, headers: Any, got: int) -> int:
    """The whole file's bytes: a 206's Content-Range total, else a 200's Content-Length."""
    found = re.fullmatch(r"bytes \d+-\d+/(\d+)", headers.get("content-range", "").strip())
    if status == 206 and found:
        return int(found.group(1))
    linked = headers.get("x-linked-size") or headers.get("content-length")
    return int(linked) if linked and linked.isdigit() else got


def _problem(error: DamagedModelError) -> str:
    """The problem a DamagedModelError states, without the local refetch hint."""
    return str(error).split(": ", 1)[-1].split("; ", 1)[0]


class NetworkError(DeviceError):
    """The Hub could not be reached or answered badly: a cached copy may answer instead."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


def _network(endpoint: str, why: str) -> NetworkError:
    return NetworkError(
        f"cannot reach {endpoint}: {why}; check the network (or HF_ENDPOINT), or work offline: download the "
        "model first (hf download ...) and run with HF_HUB_OFFLINE=1, or pass a local path or a config",
        why,
    )


@contextlib.contextmanager
def _hub_errors(repo: str, revision: str, endpoint: str) -> Iterator[None]:
    """huggingface_hub's and the transport's exceptions as DeviceErrors that name the fix."""
    try:
        yield
    except DeviceError:
        raise
    except Exception as error:
        raise _translate(error, repo, revision, endpoint) from None


def _translate(error: Exception, repo: str, revision: str, endpoint: str) -> DeviceError:
    from huggingface_hub import errors

    quoted, page = shlex.quote(repo), f"{endpoint}/{repo}"
    login = "log in (`hf auth login`, or set HF_TOKEN)"
    if isinstance(error, errors.GatedRepoError):
        return DeviceError(
            f"model={repo!r} is gated: accept its conditions on {page} with your account, {login}, and run "
            "again; or pass a config (transformers.AutoConfig) to size it without access"
        )
    if isinstance(error, errors.RevisionNotFoundError):
        return DeviceError(
            f"model={repo!r} has no revision {revision!r}: pass revision= a branch, tag or commit it has "
            f"(see {page}/tree/main), or leave it out for 'main'"
        )
    if isinstance(error, errors.RepositoryNotFoundError):
        return DeviceError(
            f"model={repo!r} is not on {endpoint}, or it is private and you may not see it: check the id "
            f"(org/name), or {login} with an account that can"
        )
    if isinstance(error, errors.OfflineModeIsEnabled):
        return DeviceError(
            f"model={repo!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: unset it, "
            f"download the model first (hf download {quoted}), or pass a local path or a config"
        )
    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, errors.HfHubHTTPError) and status in (401, 403):
        return DeviceError(f"{endpoint} refused {repo!r} ({status}): {login} with an account that may see it")
    if isinstance(error, errors.HfHubHTTPError):
        return _network(endpoint, f"it answered {status} for {repo!r}")
    # The transport's own errors (httpx's ConnectError, ReadTimeout, ...): the network, in words.
    name = type(error).__name__
    if "Timeout" in name:
        return _network(endpoint, f"no answer within {TIMEOUT_S:g} s ({name})")
    return _network(endpoint, f"{name}: {printable(str(error))[:200]}")
