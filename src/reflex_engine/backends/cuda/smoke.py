"""`reflex smoke`: load the kernel image, run one kernel on fresh inputs, check its result."""
from __future__ import annotations

import ctypes
import random
from typing import NamedTuple

from ...errors import ReflexError
from . import driver as cu
from .device import Device

N = 4096


class SmokeResult(NamedTuple):
    device: str
    compute_capability: str
    code: str  # "SASS sm_90" or "PTX compute_120"
    driver: str


def smoke(device: Device | None = None) -> SmokeResult:
    dev = device or Device()
    rng = random.Random()
    x = (ctypes.c_float * N)(*[rng.uniform(-1e3, 1e3) for _ in range(N)])
    y = (ctypes.c_float * N)(*([float("nan")] * N))  # poisoned: every element must be written
    d_x, d_y = dev.alloc(4 * N), dev.alloc(4 * N)
    dev.upload(d_x, ctypes.addressof(x), 4 * N)
    dev.launch("smoke", (-(-N // 256),), 256, (d_x, d_y, N))
    dev.download(ctypes.addressof(y), d_y, 4 * N)
    wrong = [i for i in range(N) if y[i] != ctypes.c_float(2.0 * x[i] + i).value]
    if wrong:
        i = wrong[0]
        raise ReflexError(f"smoke kernel gave a wrong result on {dev.info.name}: y[{i}] = {y[i]}, expected {2 * x[i] + i} "
                          f"({len(wrong)} of {N} wrong)")
    major, minor = dev.info.compute_capability
    image = dev.image
    return SmokeResult(dev.info.name, f"{major}.{minor}", f"{'SASS' if image.kind == 'sass' else 'PTX'} {image.arch}",
                       cu.version_text(dev.info.driver_version))
