"""A Hugging Face Hub on loopback: the endpoints `huggingface_hub`'s `snapshot_download` and `hf_hub_download`
call (repo info, the file tree, HEAD/GET of /resolve/), serving folders the tests write. Repos can be gated
(401 without the right token); missing repos answer 404 the way the Hub does; every request is recorded
so that a test can count downloads."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

TOKEN = "hf_loopback_token"


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit sha -> path -> content
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit sha
    gated: bool = False

    def commit_of(self, rev: str) -> str | None:
        return rev if rev in self.commits else self.refs.get(rev)


class LoopbackHub:
    """`url` is what HF_ENDPOINT points at; `requests` lists (method, path) of every request served."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._serve(self, body=True)

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, repo_id: str, folder: str | Path, *, revision: str = "main", gated: bool = False) -> str:
        """Publish every file under `folder` as `repo_id` at branch/tag `revision`; returns the commit sha."""
        folder = Path(folder)
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
        digest = hashlib.sha1(repo_id.encode())
        for name, data in sorted(files.items()):
            digest.update(name.encode() + hashlib.sha1(data).digest())
        commit = digest.hexdigest()
        repo = self.repos.setdefault(repo_id, Repo())
        repo.commits[commit] = files
        repo.refs[revision] = commit
        repo.gated = repo.gated or gated
        return commit

    def repo_requests(self, repo_id: str) -> list[tuple[str, str]]:
        """The requests about `repo_id` (its info, tree and files), in order."""
        with self._lock:
            return [
                (m, p)
                for m, p in self.requests
                if p.startswith((f"/api/models/{repo_id}/", f"/{repo_id}/")) or p == f"/api/models/{repo_id}"
            ]

    def downloads(self, repo_id: str | None = None) -> list[str]:
        """The file paths fetched with GET .../resolve/... (of `repo_id` if given), in order."""
        with self._lock:
            reqs = list(self.requests)
        out = []
        for method, path in reqs:
            if method == "GET" and "/resolve/" in path:
                repo, _, rest = path.lstrip("/").partition("/resolve/")
                if repo_id is None or repo == repo_id:
                    out.append(rest.split("/", 1)[1])
        return out

    # ---- serving ---------------------------------------------------------------------------------------
    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        with self._lock:
            self.requests.append((h.command, path))
        if path.startswith("/api/models/"):
            self._api(h, path[len("/api/models/") :], body)
        elif "/resolve/" in path:
            self._resolve(h, path, body)
        else:
            self._error(h, 404, "EntryNotFound", "not found", body)

    def _find(self, h: BaseHTTPRequestHandler, spec: str, body: bool) -> tuple[str, Repo, str] | None:
        """(repo id, repo, rest of the path) for the longest known repo id `spec` starts with, or an error."""
        for repo_id in sorted(self.repos, key=len, reverse=True):
            if spec == repo_id or spec.startswith(repo_id + "/"):
                return repo_id, self.repos[repo_id], spec[len(repo_id) :].lstrip("/")
        self._error(h, 404, "RepoNotFound", "Repository not found", body)
        return None

    def _api(self, h: BaseHTTPRequestHandler, spec: str, body: bool) -> None:
        found = self._find(h, spec, body)
        if found is None:
            return
        repo_id, repo, rest = found
        kind, _, rev = rest.partition("/")
        if kind not in ("", "revision", "tree"):
            return self._error(h, 404, "EntryNotFound", "not found", body)
        commit = repo.commit_of(rev or "main")
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", body)
        files = repo.commits[commit]
        if kind == "tree":
            entries = [
                {"type": "file", "oid": hashlib.sha1(d).hexdigest(), "size": len(d), "path": p}
                for p, d in sorted(files.items())
            ]
            return self._json(h, entries, body)
        info = {
            "_id": commit[:24],
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit,
            "private": False,
            "gated": "auto" if repo.gated else False,
            "disabled": False,
            "tags": [],
            "siblings": [{"rfilename": p} for p in sorted(files)],
        }
        self._json(h, info, body)

    def _resolve(self, h: BaseHTTPRequestHandler, path: str, body: bool) -> None:
        spec, _, rest = path.lstrip("/").partition("/resolve/")
        repo = self.repos.get(spec)
        if repo is None:
            return self._error(h, 404, "RepoNotFound", "Repository not found", body)
        rev, _, fname = rest.partition("/")
        commit = repo.commit_of(rev)
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", body)
        if repo.gated and h.headers.get("Authorization") != f"Bearer {TOKEN}":
            msg = f"Access to model {spec} is restricted. You must have access to it and be authenticated."
            return self._error(h, 401, "GatedRepo", msg, body)
        data = repo.commits[commit].get(fname)
        if data is None:
            return self._error(h, 404, "EntryNotFound", f"{fname} does not exist", body)
        h.send_response(200)
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _json(self, h: BaseHTTPRequestHandler, obj: Any, body: bool) -> None:
        data = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str, body: bool) -> None:
        data = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)


def point_hf_at(monkeypatch: pytest.MonkeyPatch, endpoint: str, cache: Path, offline: bool = False) -> None:
    """HF_ENDPOINT, the cache and offline mode for this process (huggingface_hub reads them into constants at
    import, so those are patched too) and for the processes it starts (the environment)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    set_offline(monkeypatch, offline)


def set_offline(monkeypatch: pytest.MonkeyPatch, offline: bool) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
