"""A local Hugging Face Hub for tests: the endpoints huggingface_hub calls, on 127.0.0.1.

It answers the model-info API (``/api/models/ORG/NAME[/revision/REV]``), file resolves
(``/ORG/NAME/resolve/REV/FILE``, GET and HEAD; safetensors files redirect to a ``/cdn/`` path, as
the Hub's LFS files do, with X-Linked-Size, X-Linked-Etag and X-Repo-Commit) and byte ranges
(206 + Content-Range), with the Hub's error codes: 401 RepoNotFound for a missing or private repo,
401/403 GatedRepo, 404 RevisionNotFound and EntryNotFound. Tests point HF_ENDPOINT at it, so the
real huggingface_hub client (and from_pretrained) talks to it.

A repo's file is real bytes (a tiny checkpoint saved with save_pretrained) or a header-only
safetensors file: its real 8-byte length and header, then zeros up to the size the header
describes, made on the fly and never stored. The server counts the bytes it sends of every file
and the furthest byte of each, so a test can tell that no tensor byte left it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

TOKEN = "hf_test_token_with_access"  # the token the gated repos accept
_CHUNK = 1 << 16


@dataclass
class HeaderOnly:
    """A safetensors file of ``size`` bytes of which only ``head`` (the length and the header) is real."""

    head: bytes
    size: int

    def read(self, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``start`` to ``end`` (inclusive), in chunks: the header's, then zeros."""
        pos = start
        while pos <= end:
            stop = min(end + 1, pos + _CHUNK)
            real = self.head[pos:stop] if pos < len(self.head) else b""
            yield real + bytes(stop - pos - len(real))
            pos = stop


@dataclass
class Repo:
    files: dict[str, bytes | HeaderOnly]
    revisions: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    gated: bool = False
    private: bool = False

    def commit(self, revision: str) -> str | None:
        if revision in self.revisions.values():
            return revision
        return self.revisions.get(revision)


def commit_of(name: str, revision: str = "main") -> str:
    return hashlib.sha1(f"{name}@{revision}".encode()).hexdigest()


@dataclass
class Sent:
    method: str
    path: str
    status: int
    bytes: int
    span: tuple[int, int] | None  # the byte range of the file sent, if a file's bytes were sent


class HubServer:
    """``with HubServer() as hub: hub.add("org/name", files); os.environ["HF_ENDPOINT"] = hub.url``."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.sent: list[Sent] = []
        self.mode: str | None = None  # "hang", "error500", "ignore-range", "trickle": failures on demand
        self.hang_s = 30.0
        # "trickle": JSON answers (model-info, config, index) sent one byte every trickle_s seconds for
        # trickle_for seconds, then the rest at once (so a client without a deadline still ends).
        self.trickle_s, self.trickle_for = 0.25, 8.0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.hub = self  # type: ignore[attr-defined]
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, name: str, files: dict[str, bytes | HeaderOnly], **kwargs: object) -> Repo:
        revisions = {"main": commit_of(name)}
        repo = Repo(files, revisions, **kwargs)  # type: ignore[arg-type]
        self.repos[name] = repo
        return repo

    def add_folder(self, name: str, folder: Path, **kwargs: object) -> Repo:
        files: dict[str, bytes | HeaderOnly] = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        return self.add(name, files, **kwargs)

    def record(self, sent: Sent) -> None:
        with self._lock:
            self.sent.append(sent)

    def file_bytes(self, name: str | None = None) -> int:
        """Bytes of files sent (of the files whose path ends with ``name``)."""
        return sum(s.bytes for s in self.sent if s.span is not None and (name is None or s.path.endswith(name)))

    def furthest(self, filename: str) -> int:
        """The furthest byte of ``filename`` sent by any request (-1: none)."""
        ends = [s.span[1] for s in self.sent if s.span is not None and s.path.endswith("/" + filename)]
        return max(ends, default=-1)

    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.sent)


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            return

        def do_HEAD(self) -> None:
            self._answer(head=True)

        def do_GET(self) -> None:
            self._answer(head=False)

        # ------------------------------------------------------------------ routing

        def _answer(self, head: bool) -> None:
            if hub.mode == "hang":
                time.sleep(hub.hang_s)
                return
            if hub.mode == "error500":
                self._error(500, "ServerError", "the server broke", head)
                return
            path = unquote(self.path.split("?", 1)[0])
            api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
            if api:
                self._model_info(api.group(1), api.group(2) or "main", head)
                return
            resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if resolve:
                self._resolve(*resolve.groups(), head)
                return
            cdn = re.fullmatch(r"/cdn/([^/]+/[^/]+)/([0-9a-f]{40})/(.+)", path)
            if cdn:
                self._file(cdn.group(1), cdn.group(3), head)
                return
            self._error(404, None, "not found", head)

        def _access(self, name: str, revision: str, head: bool) -> tuple[Repo, str] | None:
            repo = hub.repos.get(name)
            auth = self.headers.get("Authorization", "")
            if repo is None or (repo.private and auth != f"Bearer {TOKEN}"):
                self._error(401, "RepoNotFound", "Repository not found", head)
                return None
            commit = repo.commit(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", "Invalid rev id", head)
                return None
            return repo, commit

        def _model_info(self, name: str, revision: str, head: bool) -> None:
            found = self._access(name, revision, head)
            if found is None:
                return
            repo, commit = found
            info = {
                "_id": commit[:24],
                "id": name,
                "modelId": name,
                "sha": commit,
                "private": repo.private,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "tags": [],
                "siblings": [{"rfilename": f} for f in sorted(repo.files)],
            }
            raw = repo.files.get("config.json")
            try:
                config = json.loads(raw) if isinstance(raw, bytes) else None
            except ValueError:
                config = None
            if isinstance(config, dict):  # the Hub's summary of a transformers model's config
                info["library_name"] = "transformers"
                info["config"] = {k: config[k] for k in ("architectures", "model_type") if k in config}
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head, span=False)

        def _resolve(self, name: str, revision: str, filename: str, head: bool) -> None:
            found = self._access(name, revision, head)
            if found is None:
                return
            repo, commit = found
            auth = self.headers.get("Authorization", "")
            if repo.gated and auth != f"Bearer {TOKEN}":
                code = 403 if auth else 401
                self._error(code, "GatedRepo", f"Access to model {name} is restricted.", head)
                return
            content = repo.files.get(filename)
            if content is None:
                self._error(404, "EntryNotFound", f"{filename} does not exist on {revision}", head, commit)
                return
            etag = hashlib.sha256(f"{name}/{commit}/{filename}".encode()).hexdigest()
            size = content.size if isinstance(content, HeaderOnly) else len(content)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
            if filename.endswith(".safetensors"):  # an LFS file: the Hub redirects to its storage
                # On another origin, as the Hub's CDN is: huggingface_hub stops there and reads this answer.
                cdn = hub.url.replace("127.0.0.1", "localhost")
                headers.update({"Location": f"{cdn}/cdn/{name}/{commit}/{filename}", "X-Linked-Size": str(size)})
                headers["X-Linked-Etag"] = f'"{etag}"'
                self._send(302, b"", headers, head, span=False)
                return
            self._send_file(content, headers, head)

        def _file(self, name: str, filename: str, head: bool) -> None:
            repo = hub.repos.get(name)
            content = repo.files.get(filename) if repo is not None else None
            if content is None:
                self._error(404, None, "no such blob", head)
                return
            etag = hashlib.sha256(f"{name}/{filename}".encode()).hexdigest()
            self._send_file(content, {"ETag": f'"{etag}"', "Accept-Ranges": "bytes"}, head)

        # ---------------------------------------------------------------- sending

        def _send_file(self, content: bytes | HeaderOnly, headers: dict[str, str], head: bool) -> None:
            size = content.size if isinstance(content, HeaderOnly) else len(content)
            start, end, status = 0, size - 1, 200
            wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "").strip())
            if wanted and hub.mode != "ignore-range":
                start = int(wanted.group(1))
                end = min(int(wanted.group(2)) if wanted.group(2) else size - 1, size - 1)
                if start >= size:
                    self._error(416, None, "range not satisfiable", head)
                    return
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end}/{size}"
            headers["Content-Length"] = str(end - start + 1)
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if head:
                hub.record(Sent("HEAD", self.path, status, 0, None))
                return
            if hub.mode == "trickle" and not isinstance(content, HeaderOnly):
                _trickle(self, content[start : end + 1])
                hub.record(Sent("GET", self.path, status, end - start + 1, (start, end)))
                return
            chunks = content.read(start, end) if isinstance(content, HeaderOnly) else iter([content[start : end + 1]])
            sent = 0
            try:
                for chunk in chunks:
                    self.wfile.write(chunk)
                    sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            hub.record(Sent("GET", self.path, status, sent, (start, start + sent - 1)))

        def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool, *, span: bool) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            hub.record(Sent(self.command, self.path, status, 0 if head else len(body), None))
            if not head and hub.mode == "trickle":
                _trickle(self, body)
            elif not head:
                self.wfile.write(body)

        def _error(self, status: int, code: str | None, message: str, head: bool, commit: str | None = None) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send(status, json.dumps({"error": message}).encode(), headers, head, span=False)

    return Handler


def _trickle(handler: BaseHTTPRequestHandler, body: bytes) -> None:
    """``body`` a byte at a time (each flushed) for the hub's trickle_for seconds, then the rest."""
    hub_of = handler.server.hub  # type: ignore[attr-defined]
    until = time.monotonic() + hub_of.trickle_for
    sent = 0
    try:
        while sent < len(body) and time.monotonic() < until:
            handler.wfile.write(body[sent : sent + 1])
            handler.wfile.flush()
            sent += 1
            time.sleep(hub_of.trickle_s)
        handler.wfile.write(body[sent:])
    except (BrokenPipeError, ConnectionResetError):
        handler.close_connection = True


@contextlib.contextmanager
def serving(monkeypatch: Any, tmp_path: Path) -> Iterator[HubServer]:
    """A test Hub that huggingface_hub, transformers and whichdevice talk to, with empty caches.

    HF_ENDPOINT is set, and huggingface_hub's constants that it read from the environment at
    import (the endpoint, its URL template, offline mode, the cache) follow, as a process started
    with these variables would have them."""
    from huggingface_hub import constants

    with HubServer() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        yield hub


@contextlib.contextmanager
def docs_hub() -> Iterator[HubServer]:
    """serving() for a docs block (tests/doc_blocks.py, ``test="hub"``), which runs in a process of its
    own: the header-only repos of tests/hub_fixtures.py served, the environment set and put back."""
    import os

    from huggingface_hub import constants

    from hub_fixtures import large_repos

    saved = {k: os.environ.get(k) for k in ("HF_ENDPOINT", "HF_HUB_OFFLINE")}
    kept = (constants.ENDPOINT, constants.HUGGINGFACE_CO_URL_TEMPLATE, constants.HF_HUB_OFFLINE)
    with HubServer() as hub:
        for name, files in large_repos().items():
            hub.add(name, files)
        os.environ["HF_ENDPOINT"] = hub.url
        os.environ.pop("HF_HUB_OFFLINE", None)
        constants.ENDPOINT, constants.HF_HUB_OFFLINE = hub.url, False
        constants.HUGGINGFACE_CO_URL_TEMPLATE = hub.url + "/{repo_id}/resolve/{revision}/{filename}"
        try:
            yield hub
        finally:
            constants.ENDPOINT, constants.HUGGINGFACE_CO_URL_TEMPLATE, constants.HF_HUB_OFFLINE = kept
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
