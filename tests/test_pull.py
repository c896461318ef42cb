"""`reflex pull` and hub specs as MODEL, against a local HTTP server that imitates the two hub
endpoints hf_hub_download uses: HEAD /{repo}/resolve/{revision}/{file}, answered as the hub
answers for an LFS file (a redirect carrying X-Repo-Commit, X-Linked-Etag = sha256 and
X-Linked-Size), and GET on the redirect's target, with Range for resuming. No internet needed."""
import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

FIXTURE = os.path.join(os.path.dirname(__file__), "goldens", "qwen3", "qwen3-Q4_K.gguf")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SPEC = "org/qwen3:qwen3-Q4_K.gguf"
# repos that fail as the hub does: status and X-Error-Code
FAILING = {"org/missing": (404, "RepoNotFound"), "org/gated": (401, "GatedRepo"),
           "org/private": (401, "RepoNotFound"), "org/forbidden": (403, None)}


class FakeHub:
    """The hub's state, and two servers: the hub, whose HEAD /resolve redirects to a "CDN" on
    another origin (as huggingface.co does for LFS files), and that CDN, which serves the bytes."""

    def __init__(self):
        self.content = Path(FIXTURE).read_bytes()
        self.served = self.content  # what the CDN sends; the advertised sha256 is always the content's
        self.drop_after = None      # bytes the first GET sends before it drops the connection
        self.requests = []          # (method, path, Range header) of every file request
        self.servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), HubHandler) for _ in range(2)]
        for server in self.servers:
            server.hub, server.daemon_threads = self, True
        # another host name, not just another port: huggingface_hub follows redirects within one host
        self.url, self.cdn_url = (f"http://{host}:{s.server_port}" for host, s in zip(("127.0.0.1", "localhost"), self.servers))


class HubHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, status, headers, body=b""):
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", headers.get("Content-Length", str(len(body))))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self):
        hub = self.server.hub
        if self.path.startswith("/cdn/"):
            hub.requests.append((self.command, self.path, self.headers.get("Range")))
            return self._blob(hub)
        parts = self.path.lstrip("/").split("/", 4)
        if len(parts) != 5 or parts[2] != "resolve":  # e.g. /api/agent-harnesses, which huggingface_hub 2.x asks for
            return self._send(404, {})
        hub.requests.append((self.command, self.path, self.headers.get("Range")))
        org, name, _, revision, filename = parts
        repo = f"{org}/{name}"
        assert revision in ("main", COMMIT), self.path
        if repo in FAILING:
            status, code = FAILING[repo]
            return self._send(status, {"X-Error-Code": code} if code else {})
        if repo != "org/qwen3" or filename != "qwen3-Q4_K.gguf":
            return self._send(404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
        self._send(302, {"Location": f"{hub.cdn_url}/cdn/{filename}", "X-Repo-Commit": COMMIT,
                         "X-Linked-Etag": f'"{hashlib.sha256(hub.content).hexdigest()}"',
                         "X-Linked-Size": str(len(hub.content))})

    def _blob(self, hub):
        body, start, status, headers = hub.served, 0, 200, {}
        if self.headers.get("Range"):
            start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
            status, headers = 206, {"Content-Range": f"bytes {start}-{len(body) - 1}/{len(body)}"}
        if self.command == "GET" and hub.drop_after is not None:
            cut, hub.drop_after = hub.drop_after, None
            self.send_response(status)
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            self.wfile.write(body[start:start + cut])
            self.close_connection = True  # the body ends early: the client sees a dropped connection
            return
        self._send(status, headers, body[start:])

    do_HEAD = do_GET = _handle


@pytest.fixture
def hub():
    hub = FakeHub()
    for server in hub.servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield hub
    for server in hub.servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def env(hub, tmp_path):
    return {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1", "HF_HUB_DOWNLOAD_TIMEOUT": "10", "HF_HUB_ETAG_TIMEOUT": "10"}


def reflex(*args, env):
    return subprocess.run([sys.executable, "-m", "reflex_engine", *args], capture_output=True, text=True,
                          timeout=120, env=env, check=False)


def assert_one_line_error(proc, *needles, after_retries=False):
    """One line on stderr; after_retries: huggingface_hub's own retry warnings may come first."""
    assert proc.returncode != 0 and proc.stdout == "" and "Traceback" not in proc.stderr
    last = proc.stderr.splitlines()[-1] if proc.stderr else ""
    assert last.startswith("reflex: error: ") and (after_retries or proc.stderr == last + "\n"), proc.stderr
    for needle in needles:
        assert needle in last, proc.stderr


def blobs(tmp_path):
    folder = tmp_path / "hf" / "hub" / "models--org--qwen3" / "blobs"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_pull_prints_the_path_and_info_opens_the_spec(hub, env, tmp_path):
    out = reflex("pull", SPEC, env=env)
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip()
    assert out.stdout.count("\n") == 1 and Path(path).read_bytes() == hub.content
    assert blobs(tmp_path) == [hashlib.sha256(hub.content).hexdigest()]
    info = reflex("info", SPEC, "--json", env=env)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["architecture"] == "qwen3"
    pinned = reflex("info", f"org/qwen3@{COMMIT}:qwen3-Q4_K.gguf", env=env)
    assert pinned.returncode == 0, pinned.stderr


def test_dropped_download_resumes_with_a_range_request(hub, env):
    # huggingface_hub writes in 10 MiB chunks and resumes after the last whole one: serve 12 MiB
    hub.content = hub.served = (hub.content * 23)[:12 << 20]
    hub.drop_after = 11 << 20
    out = reflex("pull", SPEC, env=env)
    assert out.returncode == 0, out.stderr
    gets = [r for r in hub.requests if r[0] == "GET"]
    assert [r[2] for r in gets] == [None, f"bytes={10 << 20}-"]
    assert Path(out.stdout.strip()).read_bytes() == hub.content


def test_corrupted_download_is_refused_and_removed(hub, env, tmp_path):
    bad = bytearray(hub.content)
    bad[len(bad) // 2] ^= 0xFF
    hub.served = bytes(bad)
    assert_one_line_error(reflex("pull", SPEC, env=env), "checksum mismatch")
    assert blobs(tmp_path) == []
    assert_one_line_error(reflex("info", SPEC, env=env), "checksum mismatch")
    hub.served = hub.content  # once the hub serves the right bytes, a retry succeeds
    assert reflex("info", SPEC, env=env).returncode == 0


@pytest.mark.parametrize("spec, needle", [
    ("org/missing:model.gguf", "repository not found"),
    ("org/qwen3:nope.gguf", "no such file in the repository"),
    ("org/gated:model.gguf", "gated"),
    ("org/private:model.gguf", "HF_TOKEN"),
    ("org/forbidden:model.gguf", "not authorized (HTTP 403)"),
    ("org/qwen3@v1:a:b.gguf", "not a hub model spec"),
    ("org/qwen3/qwen3-Q4_K.gguf", "org/qwen3/qwen3-Q4_K.gguf"),  # not a spec: a missing local path
])
def test_errors_are_one_line(hub, env, spec, needle):
    assert_one_line_error(reflex("pull", spec, env=env) if ":" in spec else reflex("info", spec, env=env), needle)


def test_unreachable_hub_and_offline_mode(hub, env):
    # the discard port: nothing listens. huggingface_hub retries 5 times with backoff first (~25 s)
    unreachable = {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}
    assert_one_line_error(reflex("pull", SPEC, env=unreachable), "cannot reach http://127.0.0.1:9", after_retries=True)
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    assert_one_line_error(reflex("info", SPEC, env=offline), "HF_HUB_OFFLINE")
    assert reflex("pull", SPEC, env=env).returncode == 0
    hub.requests.clear()
    out = reflex("tokenize", SPEC, "Hello", env=offline)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
    assert hub.requests == []


def test_without_huggingface_hub(env, tmp_path):
    shadow = tmp_path / "shadow" / "huggingface_hub"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed')\n")
    no_hub = {**env, "PYTHONPATH": os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])}
    assert_one_line_error(reflex("pull", SPEC, env=no_hub), "pip install 'reflex-engine[hub]'")


def test_a_local_file_never_imports_huggingface_hub(env):
    code = ("import sys; from reflex_engine.cli import main; main(['info', sys.argv[1]]);"
            "assert 'huggingface_hub' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code, FIXTURE], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert out.returncode == 0, out.stderr
