"""A local Hugging Face Hub: the HTTP endpoints huggingface_hub calls to download a model, on
127.0.0.1 at a random port, serving repos from folders. Point HF_ENDPOINT at `hub.url`.

Endpoints (as the Hub answers them, headers included):
  GET  /api/models/{repo}[/revision/{rev}]       model info: id, sha, siblings
  GET  /api/models/{repo}/tree/{rev}[/{path}]    the file listing (one page)
  HEAD /{repo}/resolve/{rev}/{file}              X-Repo-Commit, ETag, Content-Length
  GET  /{repo}/resolve/{rev}/{file}              the bytes
Errors carry the Hub's X-Error-Code: RepoNotFound (404), RevisionNotFound (404), EntryNotFound
(404), GatedRepo (401 without a token, 403 with a token that has no access). Every request is
recorded in `requests` as (method, path), so a test can tell which files were fetched.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_INFO = re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?$")
_RESOLVE = re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


@dataclass
class Revision:
    sha: str
    files: dict[str, bytes]


@dataclass
class Repo:
    revisions: dict[str, Revision] = field(default_factory=dict)  # branch -> revision
    gated_token: str | None = None  # gated: only this token may read it

    def find(self, rev: str) -> Revision | None:
        return self.revisions.get(rev) or next((r for r in self.revisions.values() if r.sha == rev), None)


class LocalHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self._server: ThreadingHTTPServer | None = None

    def add(self, repo_id: str, files: dict[str, bytes] | str | Path, branch: str = "main",
            gated_token: str | None = None) -> str:
        """Serves `files` (a dict, or every file under a folder) as `repo_id` at `branch`; returns its sha."""
        if not isinstance(files, dict):
            root = Path(files)
            files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        sha = hashlib.sha1(f"{repo_id}@{branch}".encode() + b"".join(sorted(files.values()))).hexdigest()
        repo = self.repos.setdefault(repo_id, Repo())
        repo.revisions[branch] = Revision(sha, dict(files))
        if gated_token is not None:
            repo.gated_token = gated_token
        return sha

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def fetched(self) -> set[str]:
        """The repo files whose bytes were requested (GET .../resolve/...)."""
        return {m.group("path") for method, path in self.requests if method == "GET"
                for m in [_RESOLVE.match(path)] if m}

    def touched(self) -> set[str]:
        """The repo files named by any resolve request (HEAD or GET)."""
        return {m.group("path") for _, path in self.requests for m in [_RESOLVE.match(path)] if m}

    def start(self) -> LocalHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ------------------------------------------------------------------ answers

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path))
        for pattern, kind in ((_TREE, "tree"), (_INFO, "info"), (_RESOLVE, "resolve")):
            m = pattern.match(path)
            if m:
                break
        else:
            return _send(h, 404, b"not found", {"X-Error-Code": "RepoNotFound"}, body)
        repo = self.repos.get(m.group("repo"))
        if repo is None:
            return _send(h, 404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
        if repo.gated_token is not None:
            auth = h.headers.get("Authorization", "")
            if auth != f"Bearer {repo.gated_token}":
                status = 403 if auth else 401
                return _send(h, status, b'{"error":"Access to this model is restricted"}',
                             {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access restricted"}, body)
        revision = repo.find(m.groupdict().get("rev") or "main")
        if revision is None:
            return _send(h, 404, b'{"error":"Revision not found"}', {"X-Error-Code": "RevisionNotFound"}, body)
        if kind == "info":
            info = {"id": m.group("repo"), "sha": revision.sha, "private": False,
                    "gated": repo.gated_token is not None and "manual",
                    "siblings": [{"rfilename": name} for name in sorted(revision.files)]}
            return _send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if kind == "tree":
            prefix = (m.group("path") or "").strip("/")
            entries = [{"type": "file", "path": name, "size": len(data), "oid": _oid(data)}
                       for name, data in sorted(revision.files.items())
                       if not prefix or name.startswith(prefix + "/")]
            return _send(h, 200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, body)
        data = revision.files.get(m.group("path"))
        if data is None:
            return _send(h, 404, b'{"error":"Entry not found"}', {"X-Error-Code": "EntryNotFound"}, body)
        return _send(h, 200, data, {"X-Repo-Commit": revision.sha, "ETag": f'"{_oid(data)}"',
                                    "Content-Type": "application/octet-stream"}, body)


def _oid(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
    h.send_response(status)
    for key, value in headers.items():
        h.send_header(key, value)
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    if body:
        h.wfile.write(data)
