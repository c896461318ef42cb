"""Which file of the package's CUDA image a GPU loads (the image is made by build_kernels.py).

The image holds one cubin per architecture (sm_XY.cubin) and the PTX of the newest one
(compute_XY.ptx). A cubin runs on GPUs of its major architecture whose minor is at least its own,
so a GPU takes the cubin of its major with the highest minor <= its own; only where none exists
does it take the PTX, which the driver JIT-compiles for any GPU at least as new (slow the first
time; the driver caches the result).
manifest.json is written last by the build, so an image without one is incomplete and not used.
Standard library only: this runs on the cold path.
"""
from __future__ import annotations

import json
import os
import re
from typing import NamedTuple

from ...errors import CudaUnavailable

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMAGE_DIR = os.path.join(PACKAGE_DIR, "cuda_image")
REINSTALL = ("reinstall with nvcc or nvidia-cuda-nvrtc-cu12 available "
             "(REFLEX_CUDA=1 makes a build without kernels fail)")


class ImageChoice(NamedTuple):
    path: str
    kind: str  # "sass" (a cubin: loads as is) or "ptx" (JIT-compiled by the driver)
    arch: str  # "sm_86", "compute_120"
    min_driver_cuda: int | None = None  # oldest driver that loads it, in cuDriverGetVersion's terms (12000)


def capability(file: dict) -> tuple[int, int]:
    """"sm_86" -> (8, 6), "compute_120" -> (12, 0): the last digit is the minor."""
    digits = file["arch"].split("_", 1)[1]
    return int(digits[:-1]), int(digits[-1])


def read_manifest(image_dir: str) -> tuple[list[dict], str | None]:
    """(the image's usable files, the REFLEX_CUDA_ARCH it was narrowed by); ([], None) if none."""
    try:
        with open(os.path.join(image_dir, "manifest.json")) as fh:
            manifest = json.load(fh)
        files = [f for f in manifest["files"] if re.fullmatch(r"(sm|compute)_\d{2,3}", str(f.get("arch")))
                 and f.get("kind") in ("sass", "ptx") and os.path.isfile(os.path.join(image_dir, f["file"]))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [], None
    return files, manifest.get("narrowed_by")


def choose(files: list[dict], device: tuple[int, int]) -> dict | None:
    sass = [f for f in files if f["kind"] == "sass" and capability(f)[0] == device[0] and capability(f) <= device]
    ptx = [f for f in files if f["kind"] == "ptx" and capability(f) <= device]
    return max(sass or ptx, key=capability, default=None)


def find_image(compute_capability: tuple[int, int], image_dir: str = IMAGE_DIR) -> ImageChoice:
    files, narrowed_by = read_manifest(image_dir)
    if not files:
        raise CudaUnavailable("this install has no CUDA kernels: it was built without a CUDA compiler; " + REINSTALL)
    chosen = choose(files, compute_capability)
    if chosen is None:
        have = ", ".join(f["arch"] for f in sorted(files, key=lambda f: (f["kind"] == "ptx", capability(f))))
        narrowed = f"; it was built with REFLEX_CUDA_ARCH={narrowed_by}" if narrowed_by else ""
        raise CudaUnavailable(f"this install has no CUDA kernels for compute capability "
                              f"{compute_capability[0]}.{compute_capability[1]} (it has {have}{narrowed})")
    need = (chosen.get("min_driver") or {}).get("cuda_version")
    return ImageChoice(os.path.join(image_dir, chosen["file"]), chosen["kind"], chosen["arch"], need)
