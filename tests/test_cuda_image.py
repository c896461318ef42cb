"""The choice of kernel file for a GPU, on fake image folders (no kernels need to be installed)."""
import json

import pytest

from reflex_engine.backends.cuda.image import ImageChoice, find_image
from reflex_engine.errors import ReflexError

FULL = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "compute_120")


def make_image(folder, archs, narrowed_by=None, min_cuda=12000):
    """An image as build_kernels.py lays it out: the files, then manifest.json naming them."""
    folder.mkdir(exist_ok=True)
    files = []
    for arch in archs:
        kind = "ptx" if arch.startswith("compute_") else "sass"
        name = arch + (".ptx" if kind == "ptx" else ".cubin")
        (folder / name).write_bytes(b"\x7fELF" if kind == "sass" else b".version 8.8")
        files.append({"file": name, "kind": kind, "arch": arch, "min_driver": {"cuda_version": min_cuda}})
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "files": files, "narrowed_by": narrowed_by}))
    return str(folder)


@pytest.mark.parametrize("capability, arch", [
    ((7, 5), "sm_75"), ((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 7), "sm_86"), ((8, 9), "sm_89"),
    ((9, 0), "sm_90"), ((10, 0), "sm_100"), ((10, 3), "sm_100"), ((12, 0), "sm_120"), ((12, 1), "sm_120"),
])
def test_a_gpu_takes_the_cubin_of_its_major_with_the_highest_minor_not_above_its_own(tmp_path, capability, arch):
    image = make_image(tmp_path / "img", FULL)
    assert find_image(capability, image) == ImageChoice(f"{image}/{arch}.cubin", "sass", arch, 12000)


def test_a_lower_minor_of_the_same_major_serves_when_its_own_is_missing(tmp_path):
    image = make_image(tmp_path / "img", ("sm_80", "sm_90", "compute_120"))
    assert find_image((8, 6), image).arch == "sm_80"
    assert find_image((8, 9), image).arch == "sm_80"


def test_a_cubin_of_a_higher_minor_or_another_major_is_never_taken(tmp_path):
    image = make_image(tmp_path / "img", ("sm_86", "sm_90"))
    with pytest.raises(ReflexError, match=r"no CUDA kernels for compute capability 8\.0 \(it has sm_86, sm_90\)"):
        find_image((8, 0), image)
    with pytest.raises(ReflexError, match="compute capability 10.0"):
        find_image((10, 0), image)  # sm_90 SASS does not run on Blackwell


def test_ptx_is_the_fallback_for_gpus_newer_than_every_cubin(tmp_path):
    image = make_image(tmp_path / "img", FULL, min_cuda=12090)
    assert find_image((13, 0), image) == ImageChoice(f"{image}/compute_120.ptx", "ptx", "compute_120", 12090)
    assert find_image((12, 0), image).kind == "sass"  # a cubin beats JIT when both fit


def test_ptx_of_a_newer_architecture_than_the_gpu_does_not_fit(tmp_path):
    image = make_image(tmp_path / "img", ("sm_90", "compute_120"))
    with pytest.raises(ReflexError, match=r"compute capability 11\.0 \(it has sm_90, compute_120\)"):
        find_image((11, 0), image)  # the driver cannot JIT compute_120 PTX for an sm_110 GPU


def test_no_fitting_arch_names_the_narrowed_build(tmp_path):
    image = make_image(tmp_path / "img", ("sm_90",), narrowed_by="sm_90")
    with pytest.raises(ReflexError) as e:
        find_image((8, 6), image)
    assert str(e.value) == ("this install has no CUDA kernels for compute capability 8.6 (it has sm_90; "
                            "it was built with REFLEX_CUDA_ARCH=sm_90)")


@pytest.mark.parametrize("state", ["missing folder", "empty folder", "no manifest", "files missing"])
def test_an_install_without_kernels_says_so_in_one_line(tmp_path, state):
    folder = tmp_path / "img"
    if state != "missing folder":
        folder.mkdir()
    if state == "no manifest":  # an interrupted build: the manifest is written last
        (folder / "sm_90.cubin").write_bytes(b"\x7fELF")
    if state == "files missing":
        make_image(folder, ("sm_90",))
        (folder / "sm_90.cubin").unlink()
    with pytest.raises(ReflexError) as e:
        find_image((9, 0), str(folder))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("this install has no CUDA kernels: it was built without a CUDA compiler; reinstall with")
