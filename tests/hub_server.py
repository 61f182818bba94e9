"""A local, in-memory stand-in for the Hugging Face Hub, for offline upload/download tests.

It speaks just enough of the Hub HTTP API for the installed ``huggingface_hub`` to run
``create_repo``, ``upload_folder`` / ``create_commit`` (both the xet pipeline and the single-commit path:
``preupload`` answers ``uploadMode: "regular"`` for every file, so file contents travel base64-encoded in
the NDJSON commit and no LFS or xet storage is ever contacted), ``create_pull_request``, ``repo_info`` /
``model_info``, ``list_repo_tree``, ``get_paths_info``, ``hf_hub_download`` / ``snapshot_download`` and so
``from_pretrained``. Anything else answers 404 and is recorded in ``unhandled``.

    server = HubStandIn()           # listening on 127.0.0.1:<free port>
    ...  HF_ENDPOINT=server.url ...
    server.fail_commit_after = 0    # every commit from now on answers HTTP 500
    server.stop()
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_REPO = r"(?P<repo>[^/]+/[^/]+)"
_API = re.compile(rf"^/api/(?P<type>models|datasets|spaces)/{_REPO}(?:/(?P<action>[a-z-]+)(?:/(?P<rest>.*))?)?$")
_RESOLVE = re.compile(rf"^/(?:(?P<type>datasets|spaces)/)?{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    oid: str
    message: str
    files: dict[str, bytes]
    parent: str | None
    date: str


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    private: bool
    refs: dict[str, str] = field(default_factory=dict)  # "main", "refs/pr/1" -> commit oid
    commits: dict[str, Commit] = field(default_factory=dict)
    discussions: dict[int, dict] = field(default_factory=dict)


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None


class HubStandIn:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[Request] = []
        self.unhandled: list[str] = []
        # None: commits succeed. N: the first N commits succeed, every later one answers `fail_status`.
        self.fail_commit_after: int | None = None
        self.fail_status = 500
        self.commit_attempts = 0
        self.lock = threading.RLock()
        stand_in = self

        class Handler(_Handler):
            hub = stand_in

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="hub-stand-in", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    def __enter__(self) -> "HubStandIn":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ state helpers

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo | None:
        return self.repos.get((repo_type, repo_id))

    def files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, bytes]:
        """The files of ``repo_id`` at ``revision`` (a copy)."""
        repo = self.repo(repo_id, repo_type)
        if repo is None:
            raise KeyError(repo_id)
        return dict(repo.commits[self._resolve(repo, revision)].files)

    @staticmethod
    def _resolve(repo: Repo, revision: str) -> str | None:
        if revision in repo.refs:
            return repo.refs[revision]
        if revision in repo.commits:
            return revision
        return None

    def _new_commit(self, repo: Repo, parent: str | None, files: dict[str, bytes], message: str) -> Commit:
        digest = hashlib.sha1(json.dumps([parent, message, time.time_ns(), sorted(files)]).encode())
        for name in sorted(files):
            digest.update(files[name])
        commit = Commit(digest.hexdigest(), message, files, parent, time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()))
        repo.commits[commit.oid] = commit
        return commit


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandIn
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # quiet
        pass

    # ------------------------------------------------------------------ plumbing

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            return self.rfile.read(length)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        return b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type: str = "application/json") -> None:
        self.send_response(status)
        headers = dict(headers or {})
        headers.setdefault("Content-Type", content_type)
        headers.setdefault("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, value, status: int = 200, headers: dict | None = None) -> None:
        self._send(status, json.dumps(value).encode(), headers)

    def _error(self, status: int, message: str, code: str | None = None) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._json({"error": message}, status, headers)

    def _authorized(self) -> bool:
        auth = self.headers.get("Authorization") or ""
        if not auth.startswith("Bearer ") or len(auth) <= len("Bearer "):
            self._error(401, "Invalid credentials in Authorization header")
            return False
        return True

    def _dispatch(self) -> None:
        hub = self.hub
        split = urlsplit(self.path)
        self.query = parse_qs(split.query)
        with hub.lock:
            hub.requests.append(Request(self.command, self.path, self.headers.get("Authorization")))
        try:
            handled = self._route(split.path)
        except Exception as error:  # a bug in the stand-in: answer 500 rather than hang the client
            self._error(500, f"stand-in error: {type(error).__name__}: {error}")
            return
        if not handled:
            with hub.lock:
                hub.unhandled.append(f"{self.command} {self.path}")
            self._error(404, f"stand-in does not implement {self.command} {split.path}")

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _dispatch

    # ------------------------------------------------------------------ routes

    def _route(self, path: str) -> bool:
        method = self.command
        if path == "/api/repos/create" and method == "POST":
            return self._create_repo()
        if path == "/api/validate-yaml" and method == "POST":
            self._body()
            self._json({"errors": [], "warnings": []})
            return True
        if path == "/api/agent-harnesses" and method == "GET":
            self._json({"standardEnvVars": [], "harnesses": {}})
            return True
        if path == "/api/whoami-v2" and method == "GET":
            if self._authorized():
                self._json({"type": "user", "name": "someone", "orgs": [], "auth": {"type": "access_token"}})
            return True
        match = _RESOLVE.match(path)
        if match and method in ("GET", "HEAD"):
            repo_type = REPO_TYPES[match["type"]] if match["type"] else "model"
            return self._resolve_file(repo_type, unquote(match["repo"]), unquote(match["rev"]), unquote(match["path"]))
        match = _API.match(path)
        if not match:
            return False
        repo_type = REPO_TYPES[match["type"]]
        repo = self.hub.repo(unquote(match["repo"]), repo_type)
        action, rest = match["action"], match["rest"]
        if repo is None:
            self._body()
            self._error(404, "Repository not found", "RepoNotFound")
            return True
        if action is None and method == "GET":
            return self._repo_info(repo, "main")
        if action == "revision" and method == "GET" and rest:
            return self._repo_info(repo, unquote(rest))
        if action == "preupload" and method == "POST" and rest:
            return self._preupload(repo, unquote(rest))
        if action == "commit" and method == "POST" and rest:
            return self._commit(repo, unquote(rest))
        if action == "tree" and method == "GET" and rest:
            revision, _, sub = rest.partition("/")
            return self._tree(repo, unquote(revision), unquote(sub))
        if action == "paths-info" and method == "POST" and rest:
            return self._paths_info(repo, unquote(rest))
        if action == "discussions":
            if method == "POST" and not rest:
                return self._create_discussion(repo)
            if method == "GET" and rest and rest.isdigit():
                return self._discussion(repo, int(rest))
        return False

    def _create_repo(self) -> bool:
        if not self._authorized():
            return True
        payload = json.loads(self._body() or b"{}")
        name, organization = payload.get("name"), payload.get("organization")
        repo_type = payload.get("type") or "model"
        repo_id = f"{organization}/{name}" if organization else f"someone/{name}"
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        url = f"{self.hub.url}/{prefix}{repo_id}"
        with self.hub.lock:
            if self.hub.repo(repo_id, repo_type) is not None:
                self._json({"error": "You already created this repo", "url": url}, 409)
                return True
            repo = Repo(repo_id, repo_type, private=payload.get("visibility") == "private" or bool(payload.get("private")))
            first = self.hub._new_commit(repo, None, {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}, "initial commit")
            repo.refs["main"] = first.oid
            self.hub.repos[(repo_type, repo_id)] = repo
        self._json({"url": url, "name": repo_id, "id": hashlib.md5(repo_id.encode()).hexdigest()[:24]})
        return True

    def _revision_or_404(self, repo: Repo, revision: str) -> str | None:
        oid = HubStandIn._resolve(repo, revision)
        if oid is None:
            self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return oid

    def _repo_info(self, repo: Repo, revision: str) -> bool:
        oid = self._revision_or_404(repo, revision)
        if oid is None:
            return True
        commit = repo.commits[oid]
        config = None
        if "config.json" in commit.files:
            try:
                config = json.loads(commit.files["config.json"])
            except json.JSONDecodeError:
                config = None
        self._json(
            {
                "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
                "id": repo.repo_id,
                "author": repo.repo_id.split("/")[0],
                "sha": oid,
                "lastModified": commit.date,
                "createdAt": commit.date,
                "private": repo.private,
                "gated": False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "library_name": "transformers",
                "config": {k: config[k] for k in ("architectures", "model_type", "auto_map") if k in config} if config else None,
                "siblings": [{"rfilename": name} for name in sorted(commit.files)],
                "spaces": [],
            }
        )
        return True

    def _entry(self, name: str, data: bytes, commit: Commit) -> dict:
        return {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": name}

    def _tree(self, repo: Repo, revision: str, sub: str) -> bool:
        oid = self._revision_or_404(repo, revision)
        if oid is None:
            return True
        commit = repo.commits[oid]
        recursive = self.query.get("recursive", ["false"])[0].lower() in ("1", "true")
        sub = sub.strip("/")
        prefix = f"{sub}/" if sub else ""
        entries, folders = [], set()
        for name in sorted(commit.files):
            if not name.startswith(prefix):
                continue
            relative = name[len(prefix) :]
            parts = relative.split("/")
            for depth in range(1, len(parts)):
                folder = prefix + "/".join(parts[:depth])
                if (recursive or depth == 1) and folder not in folders:
                    folders.add(folder)
                    entries.append({"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(), "size": 0, "path": folder})
            if recursive or len(parts) == 1:
                entries.append(self._entry(name, commit.files[name], commit))
        if sub and not entries:
            self._error(404, f"{sub} does not exist on {revision}", "EntryNotFound")
            return True
        self._json(entries)
        return True

    def _paths_info(self, repo: Repo, revision: str) -> bool:
        body = self._body()
        oid = self._revision_or_404(repo, revision)
        if oid is None:
            return True
        if self.headers.get("Content-Type", "").startswith("application/json"):
            paths = json.loads(body or b"{}").get("paths", [])
        else:
            paths = parse_qs(body.decode()).get("paths", [])
        files = repo.commits[oid].files
        entries = []
        for path in paths:
            path = path.strip("/")
            if path in files:
                entries.append(self._entry(path, files[path], repo.commits[oid]))
            elif any(name.startswith(path + "/") for name in files):
                entries.append({"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path})
        self._json(entries)
        return True

    def _preupload(self, repo: Repo, revision: str) -> bool:
        payload = json.loads(self._body() or b"{}")
        if not self._authorized():
            return True
        oid = HubStandIn._resolve(repo, revision)
        if oid is None and not self.query.get("create_pr"):
            self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            return True
        existing = repo.commits[oid].files if oid else {}
        files = []
        for item in payload.get("files", []):
            data = existing.get(item["path"])
            files.append(
                {
                    "path": item["path"],
                    "uploadMode": "regular",
                    "shouldIgnore": False,
                    "oid": git_blob_sha1(data) if data is not None else None,
                }
            )
        self._json({"files": files, "commitOid": oid})
        return True

    def _commit(self, repo: Repo, revision: str) -> bool:
        body = self._body()
        if not self._authorized():
            return True
        hub = self.hub
        with hub.lock:
            hub.commit_attempts += 1
            committed = sum(1 for c in repo.commits.values() if c.parent is not None)
            failing = hub.fail_commit_after is not None and committed >= hub.fail_commit_after
        if failing:
            self._error(hub.fail_status, "Internal Error - We're working hard to fix this as soon as possible!")
            return True
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            self._error(400, "commit payload must start with a header line")
            return True
        header = lines[0]["value"]
        create_pr = bool(self.query.get("create_pr"))
        with hub.lock:
            base = HubStandIn._resolve(repo, "main" if create_pr else revision)
            if base is None:
                if revision.startswith("refs/"):
                    self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
                    return True
                base = repo.refs["main"]  # committing to a new branch creates it from main
            parent_commit = header.get("parentCommit")
            if parent_commit and not base.startswith(parent_commit):
                self._error(412, "A commit has happened since. Please refresh and try again.")
                return True
            files = dict(repo.commits[base].files)
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value", {})
                if key == "file":
                    if value.get("encoding") != "base64":
                        self._error(400, f"unsupported encoding {value.get('encoding')!r}")
                        return True
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    if files.pop(value["path"], None) is None:
                        self._error(404, "A file with this name doesn't exist", "EntryNotFound")
                        return True
                elif key == "deletedFolder":
                    for name in [n for n in files if n.startswith(value["path"].rstrip("/") + "/")]:
                        del files[name]
                else:  # lfsFile etc.: the stand-in stores no LFS objects (preupload never asks for them)
                    self._error(400, f"stand-in does not support {key!r} commit lines")
                    return True
            message = header.get("summary") or ""
            commit = hub._new_commit(repo, base, files, message)
            pr_url = None
            if create_pr:
                num = self._open_pr(repo, message, header.get("description") or "", commit.oid)
                pr_url = f"{hub.url}/{repo.repo_id}/discussions/{num}"
            else:
                repo.refs[revision] = commit.oid
        self._json(
            {
                "success": True,
                "commitOid": commit.oid,
                "commitUrl": f"{hub.url}/{repo.repo_id}/commit/{commit.oid}",
                "pullRequestUrl": pr_url,
            }
        )
        return True

    def _open_pr(self, repo: Repo, title: str, description: str, oid: str) -> int:
        num = len(repo.discussions) + 1
        repo.refs[f"refs/pr/{num}"] = oid
        repo.discussions[num] = {"title": title, "description": description, "num": num, "createdAt": repo.commits[oid].date}
        return num

    def _create_discussion(self, repo: Repo) -> bool:
        payload = json.loads(self._body() or b"{}")
        if not self._authorized():
            return True
        if not payload.get("pullRequest"):
            self._error(400, "stand-in only opens pull requests")
            return True
        with self.hub.lock:
            num = self._open_pr(repo, payload.get("title", ""), payload.get("description", ""), repo.refs["main"])
        self._json({"num": num, "url": f"{self.hub.url}/{repo.repo_id}/discussions/{num}", "pullRequest": True})
        return True

    def _discussion(self, repo: Repo, num: int) -> bool:
        if num not in repo.discussions:
            self._error(404, "Discussion not found")
            return True
        d = repo.discussions[num]
        self._json(
            {
                "title": d["title"],
                "num": num,
                "author": {"name": "someone"},
                "createdAt": d["createdAt"],
                "status": "draft",
                "repo": {"name": repo.repo_id, "type": repo.repo_type},
                "isPullRequest": True,
                "changes": {"base": "refs/heads/main"},
                "filesWithConflicts": [],
                "events": [],
                "diff": "",
            }
        )
        return True

    def _resolve_file(self, repo_type: str, repo_id: str, revision: str, path: str) -> bool:
        repo = self.hub.repo(repo_id, repo_type)
        if repo is None:
            self._error(404, "Repository not found", "RepoNotFound")
            return True
        oid = self._revision_or_404(repo, revision)
        if oid is None:
            return True
        data = repo.commits[oid].files.get(path)
        if data is None:
            self._error(404, "Entry not found", "EntryNotFound")
            return True
        etag = git_blob_sha1(data)
        status, extra = 200, {}
        ranged = re.match(r"^bytes=(\d+)-(\d*)$", self.headers.get("Range") or "")
        if ranged and self.command == "GET":
            start = int(ranged[1])
            end = int(ranged[2]) if ranged[2] else len(data) - 1
            extra = {"Content-Range": f"bytes {start}-{end}/{len(data)}"}
            status, data = 206, data[start : end + 1]
        self._send(
            status,
            data,
            {
                **extra,
                "ETag": f'"{etag}"',
                "X-Repo-Commit": oid,
                "Accept-Ranges": "bytes",
                "Content-Disposition": f"inline; filename*=UTF-8''{quote(path.split('/')[-1])}",
            },
            content_type="application/octet-stream",
        )
        return True
