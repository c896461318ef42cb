"""Fault injection (issue 14): the model file changed on disk while it loads, device memory that
runs out part way through a load, a disk that fills while MODEL.reflex or a KV state file is
written. Each is one clear error, and nothing is lost or left half-done. (The engine killed under
the sidecar: sidecar/tests/test_openai_lifecycle.py; a KV state file of another model:
test_kvstate.py's test_another_models_file_is_refused. docs/reliability.md lists them all.)"""
import errno
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import reflex_engine
from reflex_engine import cli, kvstate, native, sidecar
from reflex_engine.engine import ModelFile
from reflex_engine.errors import GGUFError, ReflexError
from reflex_engine.sampling import SamplingParams
from test_goldens import paths

QWEN3 = paths("qwen3", "Q4_0")[0]
SAME_SIZE = paths("qwen3", "Q4_K")[0]  # 569,824 bytes, as Q4_0
LARGER = paths("qwen3", "Q8_0")[0]
SRC = os.path.join(os.path.dirname(__file__), "..", "src")
GREEDY = SamplingParams(temperature=0)


@pytest.fixture
def model(tmp_path):
    """A copy of the qwen3 golden, its mtime in the past (a rewrite then always changes it)."""
    path = tmp_path / "m.gguf"
    shutil.copy(QWEN3, path)
    os.utime(path, (1e9, 1e9))
    return str(path)


def greedy(model_file) -> list[int]:
    return list(model_file.load("cpu").generate([1, 2, 3], max_tokens=4, sampling=GREEDY).tokens)


def cli_with_load_hook(hook: str, model: str) -> subprocess.CompletedProcess:
    """`reflex generate MODEL` in a fresh process, with `hook(gguf)` run just before the weights
    are read (the model is open, its tensor directory parsed)."""
    script = textwrap.dedent(f"""
        import os, shutil, sys
        from reflex_engine import cli, engine
        real = engine.load_weights
        def hooked(gguf, *args, **kwargs):
            {hook}
            return real(gguf, *args, **kwargs)
        engine.load_weights = hooked
        sys.exit(cli.main(["generate", {model!r}, "hi", "--device", "cpu", "-n", "2", "--temp", "0"]))
    """)
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC)}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)


# -- the model file, changed while it loads ---------------------------------------------------------


@pytest.mark.skipif(native.skip_strings is None, reason="no compiled _native in this install")
@pytest.mark.parametrize("cut", ["data", "everything"])
def test_a_model_truncated_while_loading_is_one_line_and_exit_2_not_sigbus(model, cut):
    # the next read of a mapped page past the new end is SIGBUS: Python cannot catch it
    to = "gguf.data_offset" if cut == "data" else "0"
    done = cli_with_load_hook(f"os.truncate(gguf.path, {to})", model)
    assert done.returncode == native.SIGBUS_EXIT, (done.returncode, done.stderr)
    assert done.stderr.splitlines() == [native.SIGBUS_MESSAGE.strip()]


def test_a_model_rewritten_in_place_while_loading_is_refused(model):
    # `cp other.gguf m.gguf` truncates then writes: every page is readable again, with other bytes
    done = cli_with_load_hook(f"shutil.copyfile({LARGER!r}, gguf.path)", model)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "changed on disk while in use" in done.stderr
    assert "REFLEX_GENERATE_OK" not in done.stdout


def test_a_same_size_rewrite_in_place_is_refused(model):
    file = ModelFile(model)
    with open(model, "r+b") as f, open(SAME_SIZE, "rb") as other:
        f.write(other.read())
    assert os.path.getsize(model) == os.path.getsize(QWEN3)
    with pytest.raises(GGUFError, match=r"m\.gguf: changed on disk while in use \(569824 bytes when opened, 569824 now\)"):
        file.load("cpu")


def test_a_model_replaced_by_rename_while_loading_loads_the_file_it_opened(model, tmp_path):
    expected = greedy(ModelFile(QWEN3))
    file = ModelFile(model)
    new = tmp_path / "new.gguf"
    shutil.copy(LARGER, new)
    os.replace(new, model)  # what a download tool or `mv` does: the mapping keeps the old inode
    assert greedy(file) == expected
    os.unlink(model)
    assert greedy(file) == expected


@pytest.mark.skipif(native.skip_strings is None, reason="no compiled _native in this install")
@pytest.mark.parametrize("change", ["truncate", "rename over"])
def test_a_kv_state_file_changed_while_it_is_imported(model, tmp_path, change):
    """--import-kv maps the file after checking its header: truncated once mapped is SIGBUS's one
    line; replaced between the header and the mapping, it is refused (the header was another file's)."""
    state = str(tmp_path / "state.kv")
    assert cli.main(["generate", model, "hi", "--device", "cpu", "-n", "2", "--export-kv", state]) == 0
    shutil.copy(state, tmp_path / "other.kv")
    if change == "truncate":
        hook = "with real(state, n) as arrays:\n        os.truncate(state.path, 64)\n        yield arrays"
    else:
        hook = f"os.replace({str(tmp_path / 'other.kv')!r}, state.path)\n    with real(state, n) as arrays:\n        yield arrays"
    script = textwrap.dedent("""
        import contextlib, os, sys
        from reflex_engine import cli, kvstate
        real = kvstate.mapped_arrays
        @contextlib.contextmanager
        def hooked(state, n):
            HOOK
        kvstate.mapped_arrays = hooked
        sys.exit(cli.main(["generate", MODEL, "more", "--device", "cpu", "-n", "2", "--import-kv", STATE]))
    """).replace("HOOK", hook).replace("MODEL", repr(model)).replace("STATE", repr(state))
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    if change == "truncate":
        assert done.returncode == native.SIGBUS_EXIT and done.stderr.splitlines() == [native.SIGBUS_MESSAGE.strip()]
    else:
        assert done.returncode == 1 and done.stderr.splitlines() == [f"reflex: error: {state} changed while it was being read"]


# -- device memory runs out part way through a load ---------------------------------------------------


@pytest.mark.parametrize("fail_at", [1, 3, 6])
def test_cuda_out_of_memory_mid_load_is_one_line(fake, capsys, fail_at):
    """The memory plan passed (free memory looked enough), then the fail_at-th cuMemAlloc of the
    load fails, as when another process took the memory meanwhile: one line, no allocation after
    the failed one, and the ones before it given back (a Python caller that catches the error and
    retries keeps nothing)."""
    lib = fake()
    calls, live = [], set()

    def alloc(ptr, nbytes):
        calls.append(nbytes)
        if len(calls) == fail_at:
            return 2  # CUDA_ERROR_OUT_OF_MEMORY
        ptr._obj.value = (1 << 40) + len(calls) * (1 << 32)
        live.add(ptr._obj.value)
        return 0

    def free(ptr):
        live.remove(ptr)
        return 0

    lib.cuMemAlloc_v2, lib.cuMemFree_v2 = alloc, free
    code = cli.main(["generate", QWEN3, "hi", "--device", "cuda", "-n", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == ["reflex: error: CUDA driver call cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (2)"]
    assert len(calls) == fail_at  # no allocation after the failed one
    assert not live


# -- the disk fills while a file is written ---------------------------------------------------------


def failing_writes(monkeypatch, after: int):
    """Writes to files opened "wb" raise ENOSPC once `after` bytes went through, as a full disk."""
    import builtins

    real_open, written = builtins.open, [0]

    class Full:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            n = memoryview(data).nbytes
            if written[0] + n > after:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written[0] += n
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

    def opening(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Full(f) if "w" in mode else f

    monkeypatch.setattr(builtins, "open", opening)


@pytest.mark.parametrize("after", [0, 20, 4096])
def test_disk_full_while_preparing_keeps_the_old_sidecar(model, tmp_path, capsys, monkeypatch, after):
    assert cli.main(["prepare", model]) == 0
    before = open(sidecar.sidecar_path(model), "rb").read()
    failing_writes(monkeypatch, after)
    code = cli.main(["prepare", model])
    monkeypatch.undo()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == [f"reflex: error: cannot write {model}.reflex: No space left on device"]
    assert open(sidecar.sidecar_path(model), "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "m.gguf.reflex"]  # no temporary file left
    assert sidecar.read_section(model, "layout") is not None


@pytest.mark.parametrize("fraction", [0, 0.01, 0.9])
def test_disk_full_while_writing_a_kv_state_keeps_the_old_file(model, tmp_path, monkeypatch, fraction):
    m = reflex_engine.load(model, device="cpu")
    path = str(tmp_path / "state.kv")
    list(m.generate([5, 6, 7], max_tokens=2, export_kv=path))
    before = open(path, "rb").read()
    failing_writes(monkeypatch, int(fraction * len(before)))
    with pytest.raises(ReflexError, match=r"^cannot write the KV state to .*state\.kv: No space left on device$"):
        list(m.generate([8, 9, 10], max_tokens=2, export_kv=path))
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "state.kv"]
    list(m.generate([], max_tokens=1, import_kv=path))  # the old file still imports


def test_disk_full_while_baking_a_system_prompt_keeps_the_old_state(model, tmp_path, capsys, monkeypatch):
    prompt = tmp_path / "system.txt"
    prompt.write_text("You are a terse assistant.")
    assert cli.main(["prepare", model, "--system-prompt", str(prompt), "--device", "cpu"]) == 0
    baked = kvstate.baked_state_path(model)
    before = open(baked, "rb").read()
    prompt.write_text("You are a verbose assistant who explains everything.")
    real_write = kvstate.write_state

    def write_state(path, **kwargs):
        failing_writes(monkeypatch, 64)
        return real_write(path, **kwargs)

    monkeypatch.setattr(kvstate, "write_state", write_state)
    code = cli.main(["prepare", model, "--system-prompt", str(prompt), "--device", "cpu"])
    monkeypatch.undo()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == [f"reflex: error: cannot write the KV state to {baked}: No space left on device"]
    assert open(baked, "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "m.gguf.reflex", "m.gguf.reflex-kv", "system.txt"]


def tmpfs(where, size: str):
    os.makedirs(where)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")


def test_a_real_full_disk_while_preparing(tmp_path, capsys):
    """The same on a 1 MiB tmpfs that holds the model and its first MODEL.reflex, with no room for
    a second: the kernel's ENOSPC, not a simulated one."""
    disk = tmp_path / "disk"
    tmpfs(disk, "1m")
    try:
        model = str(disk / "m.gguf")
        shutil.copy(QWEN3, model)
        assert cli.main(["prepare", model]) == 0
        before = open(sidecar.sidecar_path(model), "rb").read()
        free = shutil.disk_usage(disk).free
        with open(disk / "filler", "wb") as f:  # leave less room than a second sidecar needs
            f.write(b"\0" * max(0, free - len(before) // 2))
        code = cli.main(["prepare", model])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and err == [f"reflex: error: cannot write {model}.reflex: No space left on device"]
        assert open(sidecar.sidecar_path(model), "rb").read() == before
        assert sorted(os.listdir(disk)) == ["filler", "m.gguf", "m.gguf.reflex"]
    finally:
        subprocess.run(["umount", str(disk)])
