"""One GPU as the engine uses it: the primary context, one stream, the kernel module, launches.

Asks for the primary context of a device and never assumes it created it, so a launcher that
initialised CUDA earlier in the process (the roadmap's native launcher) is served the same one.
"""
from __future__ import annotations

import ctypes
import os
from ctypes import byref, c_float, c_int, c_int64, c_uint64, c_void_p
from typing import Any, NamedTuple

from ...errors import CudaUnavailable, ReflexError
from . import driver as cu
from .image import find_image

# launch-argument kinds of the kernels' C signatures
PTR, INT, I64, F32, F64 = c_uint64, c_int, c_int64, c_float, ctypes.c_double
MAX_KERNEL_ARGS = 32  # more than any kernel in kernels/ takes


class DeviceInfo(NamedTuple):
    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    multiprocessors: int
    driver_version: int  # cuDriverGetVersion: 12040 = CUDA 12.4


class Device:
    def __init__(self, drv: cu.Driver | None = None, ordinal: int = 0):
        self.drv = drv or cu.Driver(cu.load_library())
        drv = self.drv
        drv.init()
        count = c_int()
        drv.cuDeviceGetCount(byref(count))
        if ordinal >= count.value:
            raise ReflexError(f"CUDA device {ordinal} does not exist ({count.value} found)")
        dev = c_int()
        drv.cuDeviceGet(byref(dev), ordinal)
        self.info = DeviceInfo(ordinal, drv.device_name(dev.value),
                               (drv.attribute(cu.ATTR_COMPUTE_CAPABILITY_MAJOR, dev.value),
                                drv.attribute(cu.ATTR_COMPUTE_CAPABILITY_MINOR, dev.value)),
                               drv.attribute(cu.ATTR_MULTIPROCESSOR_COUNT, dev.value), drv.version())
        self.image = find_image(self.info.compute_capability)
        self._check_image()
        self.context = c_void_p()
        drv.cuDevicePrimaryCtxRetain(byref(self.context), dev.value)
        drv.cuCtxSetCurrent(self.context)
        self.stream = c_void_p()
        drv.cuStreamCreate(byref(self.stream), cu.STREAM_NON_BLOCKING)
        with open(self.image.path, "rb") as fh:
            image = fh.read()  # the driver copies what it needs during the load
        self.module = c_void_p()
        try:
            drv.cuModuleLoadData(byref(self.module), image)
        except cu.CudaError as e:
            raise ReflexError(f"cannot load the CUDA kernels ({self.image.kind} {self.image.arch}) on "
                              f"{self.info.name} (sm_{self._sm}): {e}") from None
        self._functions: dict[str, Any] = {}
        self._params = (c_void_p * MAX_KERNEL_ARGS)()  # the addresses of a launch's arguments
        self._config = self._launch_config()
        # set by graph.py while it captures a decode step: there overlapped launches paid (H200, 0.6B
        # Q4_K_M decode 683 -> 785 tok/s), while eager prompt passes lost (512 tokens 16.8 -> 21.5 ms)
        self.overlap_launches = False

    def make_current(self) -> None:
        """Bind the context to the calling thread (it was made on the init thread)."""
        self.drv.cuCtxSetCurrent(self.context)

    @property
    def _sm(self) -> str:
        major, minor = self.info.compute_capability
        return f"{major}{minor}"

    def _check_image(self) -> None:
        need = self.image.min_driver_cuda
        if need and self.info.driver_version < need:
            raise ReflexError(f"the NVIDIA driver supports CUDA {cu.version_text(self.info.driver_version)}; these kernels "
                              f"need CUDA {cu.version_text(need)} or newer: update the driver")
        if self.image.kind == "ptx" and os.environ.get("CUDA_DISABLE_PTX_JIT") == "1":
            raise CudaUnavailable(f"this install has no SASS for {self.info.name} (sm_{self._sm}) and PTX JIT is disabled "
                              "(CUDA_DISABLE_PTX_JIT=1)")

    # -- kernels -------------------------------------------------------------------------------

    def function(self, name: str):
        fn = self._functions.get(name)
        if fn is None:
            fn = c_void_p()
            self.drv.cuModuleGetFunction(byref(fn), self.module, name.encode())
            self._functions[name] = fn
        return fn

    def _launch_config(self) -> cu.LaunchConfig | None:
        """On sm_90+, the configuration of launches while `overlap_launches` is set: programmatic
        stream serialization lets a kernel's blocks start while the kernel before it finishes (each
        kernel's first statement waits for that one's end: kernels/common.cuh follow_previous_kernel),
        so a launch's latency overlaps the previous kernel's run. REFLEX_CUDA_PDL=0: never."""
        if self.info.compute_capability < (9, 0) or os.environ.get("REFLEX_CUDA_PDL") == "0":
            return None
        self._pdl = cu.LaunchAttribute(id=cu.LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)  # held: attrs points at it
        self._pdl.value[0] = 1
        return cu.LaunchConfig(gridDimY=1, gridDimZ=1, blockDimY=1, blockDimZ=1, hStream=self.stream,
                               attrs=ctypes.pointer(self._pdl), numAttrs=1)

    def launch(self, name: str, grid: tuple[int, ...], block: int, args: tuple, smem: int = 0) -> None:
        """Enqueue kernel `name` on the stream; args are ctypes values (PTR(...), INT(...), ...)."""
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        if gx == 0 or gy == 0 or gz == 0:
            return  # nothing to do: empty tensors are legal (e.g. no logits rows in a prefill chunk)
        params = self._params  # the driver copies the arguments during the call: one array serves every launch
        params[: len(args)] = list(map(ctypes.addressof, args))
        config = self._config if self.overlap_launches else None
        if config is None:
            self.drv.cuLaunchKernel(self.function(name), gx, gy, gz, block, 1, 1, smem, self.stream, params, None)
            return
        config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX, config.sharedMemBytes = gx, gy, gz, block, smem
        self.drv.cuLaunchKernelEx(byref(config), self.function(name), params, None)

    # -- memory --------------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> int:
        return self.drv.alloc(nbytes)

    def free(self, ptr: int) -> None:
        self.drv.cuMemFree_v2(ptr)

    def free_memory(self) -> int:
        return self.drv.mem_info()[0]

    def upload(self, dst: int, src_address: int, nbytes: int) -> None:
        self.drv.cuMemcpyHtoDAsync_v2(dst, src_address, nbytes, self.stream)

    def download(self, dst_address: int, src: int, nbytes: int) -> None:
        """Copy to host memory and wait: the stream's work before it is done when this returns."""
        self.drv.cuMemcpyDtoHAsync_v2(dst_address, src, nbytes, self.stream)
        self.synchronize()

    def synchronize(self) -> None:
        self.drv.cuStreamSynchronize(self.stream)

    def copy_bandwidth(self, nbytes: int = 1 << 30, repeats: int = 5) -> float:
        """Device-to-device copy rate in bytes/s, counting the bytes read and written (the figure a
        memory-bound kernel is held to); the best of `repeats` timed copies of nbytes."""
        drv, src, dst = self.drv, self.alloc(nbytes), self.alloc(nbytes)
        begin, end, ms = c_void_p(), c_void_p(), c_float()
        drv.cuEventCreate(byref(begin), 0)
        drv.cuEventCreate(byref(end), 0)
        try:
            best = float("inf")
            for _ in range(repeats + 1):  # the first warms the copy engines up
                drv.cuEventRecord(begin, self.stream)
                drv.cuMemcpyDtoDAsync_v2(dst, src, nbytes, self.stream)
                drv.cuEventRecord(end, self.stream)
                drv.cuEventSynchronize(end)
                drv.cuEventElapsedTime(byref(ms), begin, end)
                best = min(best, ms.value)
            return 2 * nbytes / (best / 1e3)
        finally:
            for event in (begin, end):
                drv.cuEventDestroy_v2(event)
            drv.cuMemFree_v2(src)
            drv.cuMemFree_v2(dst)
