"""Models from the Hugging Face Hub: `reflex pull org/repo[@revision]:file.gguf`, and the same spec
wherever a command takes MODEL. Downloads go through huggingface_hub (an optional extra, imported
only here and only for a spec), so its cache, HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE apply.

huggingface_hub checks only a download's size; we check its content against the hub's ETag,
which for an LFS file (every GGUF) is its sha256 and for a git file its git blob sha1."""
from __future__ import annotations

import os
import re

from .errors import ReflexError

# The colon form only: `org/repo/file.gguf` would turn a mistyped local path into a network call.
_SPEC = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^:@]+))?:(?P<filename>[^:]+)")
SPEC_FORM = "org/repo[@revision]:file.gguf"


def parse_spec(spec: str) -> tuple[str, str | None, str]:
    """`org/repo@rev:dir/file.gguf` -> ("org/repo", "rev", "dir/file.gguf"); revision None = main."""
    m = _SPEC.fullmatch(spec)
    if m is None:
        raise ReflexError(f"{spec!r} is not a hub model spec {SPEC_FORM}")
    return m["repo"], m["revision"], m["filename"]


def resolve_model(model: str) -> str:
    """A MODEL argument as a local path: an existing file, or any string without a colon, is one
    already; anything else is a hub spec, downloaded (or found in the cache) first."""
    if os.path.exists(model) or ":" not in model:
        return model
    if _SPEC.fullmatch(model) is None:
        raise ReflexError(f"{model}: no such file, and not a hub model spec {SPEC_FORM}")
    return pull(model, verify_cached=False)


def pull(spec: str, *, verify_cached: bool = True) -> str:
    """Download `spec` into the huggingface_hub cache (resuming a dropped connection, with a
    progress bar on stderr) and return the local path. A file this call downloaded is always
    checked; one already cached only when verify_cached (`reflex pull` re-checks, `--model` trusts
    the cache, so a cached model costs no hashing on the cold path)."""
    repo, revision, filename = parse_spec(spec)
    try:
        import huggingface_hub
        from huggingface_hub import constants as hf_constants
        from huggingface_hub import errors as hf_errors
    except ImportError:
        raise ReflexError(f"{spec}: downloading from the hub needs huggingface_hub: pip install 'reflex-engine[hub]'") from None
    where = f"{repo}@{revision or 'main'}:{filename}"
    try:
        before = huggingface_hub.try_to_load_from_cache(repo, filename, revision=revision)
        path = huggingface_hub.hf_hub_download(repo, filename, revision=revision)
    except Exception as e:  # noqa: BLE001 - its OSErrors, ValueErrors and HTTP client errors vary by version
        raise ReflexError(f"{where}: {_describe(e, hf_errors, hf_constants)}") from None
    if verify_cached or not isinstance(before, str) or os.path.realpath(before) != os.path.realpath(path):
        _verify(path, where)
    return path


def _describe(e: Exception, hf_errors, constants) -> str:
    """One line for what huggingface_hub raised; its own messages span paragraphs."""
    # GatedRepoError is a RepositoryNotFoundError, and LocalEntryNotFoundError an EntryNotFoundError: order matters.
    if isinstance(e, hf_errors.GatedRepoError):
        return "the repository is gated: accept its terms on the hub, then set HF_TOKEN"
    if isinstance(e, hf_errors.RepositoryNotFoundError):
        return "repository not found (a private one needs HF_TOKEN)"
    if isinstance(e, hf_errors.RevisionNotFoundError):
        return "revision not found"
    if isinstance(e, hf_errors.LocalEntryNotFoundError):
        if constants.HF_HUB_OFFLINE:
            return "not in the cache, and HF_HUB_OFFLINE is set"
        if isinstance(e.__cause__, hf_errors.HfHubHTTPError):  # e.g. a 403 it fell back to the cache for
            return _describe(e.__cause__, hf_errors, constants)
        return f"cannot reach {constants.ENDPOINT}, and the file is not in the cache"
    if isinstance(e, hf_errors.EntryNotFoundError):
        return "no such file in the repository"
    if isinstance(e, hf_errors.HfHubHTTPError) and e.response is not None:
        code = e.response.status_code
        if code in (401, 403):
            return f"not authorized (HTTP {code}): set HF_TOKEN to a token with access"
        return f"the hub answered HTTP {code}"
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _verify(path: str, where: str) -> None:
    """Hash the cached blob against its name, which is the hub's ETag; a mismatch is removed."""
    import hashlib

    blob = os.path.realpath(path)
    etag = os.path.basename(blob)
    if os.path.basename(os.path.dirname(blob)) != "blobs" or not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", etag):
        raise ReflexError(f"{where}: cannot verify {path}: the hub gave no checksum for it")
    if len(etag) == 64:
        h = hashlib.sha256()
    else:  # a git blob's id: sha1 of a "blob <size>\0" header and the content
        h = hashlib.sha1(b"blob %d\0" % os.path.getsize(blob))
    with open(blob, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    if h.hexdigest() != etag:
        for p in (path, blob):  # the snapshot's link, then the blob
            if os.path.lexists(p):
                os.remove(p)
        raise ReflexError(f"{where}: checksum mismatch (expected {etag}, got {h.hexdigest()}); removed the download")
