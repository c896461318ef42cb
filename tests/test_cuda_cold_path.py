"""The CUDA backend's promises about the cold path: importing it loads neither numpy nor the
driver; on a GPU, `generate --device cuda` reaches its first token without numpy, and the
kernels load as SASS for the device with PTX JIT disabled."""
import os
import subprocess
import sys

import pytest

from test_goldens import paths

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": SRC, **env}, timeout=120)


def test_importing_the_cuda_backend_imports_no_numpy_and_opens_no_driver():
    proc = python("import sys, reflex_engine.backends.cuda, reflex_engine.cli\n"
                  "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch', 'jinja2', 'cuda')))\n"
                  "import ctypes; print('libcuda' in open('/proc/self/maps').read())")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[]", "False"]


@pytest.mark.gpu
def test_generate_on_cuda_reaches_its_tokens_without_numpy():
    proc = python("import sys\nfrom reflex_engine import cli\n"
                  f"code = cli.main(['generate', {paths('qwen3', 'Q4_K')[0]!r}, 'Hello', '--device', 'cuda', '-n', '4', '--temp', '0'])\n"
                  "print('numpy' in sys.modules, code)")
    assert proc.returncode == 0, proc.stderr
    assert 'device="cuda"' in proc.stdout
    assert proc.stdout.rstrip().split("\n")[-1] == "False 0"


@pytest.mark.gpu
def test_smoke_loads_sass_for_this_gpu_with_ptx_jit_disabled():
    proc = python("from reflex_engine import cli; raise SystemExit(cli.main(['smoke']))", CUDA_DISABLE_PTX_JIT="1")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    cc = line.split('compute_capability="')[1].split('"')[0].replace(".", "")
    assert line.startswith("REFLEX_SMOKE_OK ") and f'code="SASS sm_{cc}"' in line
