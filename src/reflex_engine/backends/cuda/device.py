"""One GPU as the engine uses it: the primary context, one stream, the kernel module, launches.

Asks for the primary context of a device and never assumes it created it, so a launcher that
initialised CUDA earlier in the process (the roadmap's native launcher) is served the same one.
"""
from __future__ import annotations

import ctypes
import os
import struct
from ctypes import byref, c_float, c_int, c_size_t, c_void_p
from typing import Any, Callable, NamedTuple

from ...errors import CudaUnavailable, ReflexError
from . import driver as cu
from .image import find_image
from .params import param_format

# cuLaunchKernel's `extra`: the arguments as one packed buffer (cuda.h CU_LAUNCH_PARAM_*)
LAUNCH_PARAM_END, LAUNCH_PARAM_BUFFER_POINTER, LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2
ARGS_BYTES = 4096  # a kernel's parameter space before CUDA 12.1; more than any kernel in kernels/ takes
_SIZES = {"P": 8, "q": 8, "d": 8, "i": 4, "f": 4}  # params.py's letters; each aligned to its size


class Kernel(NamedTuple):
    fn: c_void_p
    pack_into: Callable  # struct.Struct.pack_into of its parameters, padding and all
    extra: Any  # cuLaunchKernel's extra: the argument buffer and a pointer to `size`
    fmt: str  # params.py's letters
    size: c_size_t  # the packed bytes; held, extra points at it


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
        self._cu_device = dev.value
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
        self._shared_allowed: dict[str, int] = {}  # allow_shared's, by kernel
        self._kernels: dict[str, Kernel] = {}
        self._args = (ctypes.c_uint64 * (ARGS_BYTES // 8))()  # a launch's packed arguments
        self._config = self._launch_config()
        # set by graph.py while it captures a decode step: there overlapped launches paid (H200, 0.6B
        # Q4_K_M decode 683 -> 785 tok/s), while eager prompt passes lost (512 tokens 16.8 -> 21.5 ms)
        self.overlap_launches = False
        self._held: Callable[[], None] | None = None  # a launch held back (hold)

    def close(self) -> None:
        """Give back what this Device took once its stream's work is done: the module, the stream,
        its hold on the primary context (the driver destroys the context with the last one)."""
        drv = self.drv
        drv.cuStreamSynchronize(self.stream)
        drv.cuModuleUnload(self.module)
        drv.cuStreamDestroy_v2(self.stream)
        drv.cuDevicePrimaryCtxRelease_v2(self._cu_device)

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

    def allow_shared(self, name: str, nbytes: int) -> None:
        """Let kernel `name` take nbytes of dynamic shared memory a block (past 48 KB a kernel must be
        allowed), the SMs' L1 and shared memory split as far towards shared memory as it goes. Once a kernel: the
        callers ask at each launch, and a prompt pass would make two driver calls a layer."""
        if self._shared_allowed.get(name, -1) >= nbytes:
            return
        self._shared_allowed[name] = nbytes
        fn = self.function(name)
        self.drv.cuFuncSetAttribute(fn, cu.FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
        self.drv.cuFuncSetAttribute(fn, cu.FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)

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

    def _kernel(self, name: str) -> Kernel:
        """The kernel's packing, checked against its parameter table where the driver has one
        (CUDA 12.4+), else laid out as the C ABI would (each parameter at a multiple of its size)."""
        fmt = param_format(name)
        if fmt is None:
            raise ReflexError(f"internal error: kernel {name} is not in backends/cuda/params.py")
        fn, sizes = self.function(name), [_SIZES[c] for c in fmt]
        layout = self.drv.param_layout(fn, len(fmt) + 1)
        if layout is None:
            layout, end = [], 0
            for size in sizes:
                end = -(-end // size) * size
                layout.append((end, size))
                end += size
        if [size for _, size in layout] != sizes or any(o < p + s for (p, s), (o, _) in zip(layout, layout[1:])):
            raise ReflexError(f"kernel {name} takes {len(layout)} parameters of {[s for _, s in layout]} bytes at offsets "
                              f"{[o for o, _ in layout]}; Reflex passes {len(fmt)} ({fmt}) of {sizes}: the kernel image "
                              f"and this version of Reflex disagree")
        packing, end = "<", 0
        for (offset, size), c in zip(layout, fmt):
            packing += f"{offset - end}x{'Q' if c == 'P' else c}"
            end = offset + size
        if end > ARGS_BYTES:
            raise ReflexError(f"internal error: kernel {name} takes {end} bytes of parameters (at most {ARGS_BYTES})")
        size = c_size_t(end)
        extra = (c_void_p * 5)(LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(self._args), LAUNCH_PARAM_BUFFER_SIZE,
                               ctypes.addressof(size), LAUNCH_PARAM_END)
        kernel = self._kernels[name] = Kernel(fn, struct.Struct(packing).pack_into, extra, fmt, size)
        return kernel

    def hold(self, launch: Callable[[], None]) -> None:
        """Hold back a launch (a function that makes it) until the next launch, upload, download or
        synchronize makes it first, so that the op after the one holding it may take it over
        (take_held) and make it fused with its own work."""
        self.release()
        self._held = launch

    def take_held(self) -> Callable[[], None] | None:
        """The launch held back, no longer held: the caller makes it, or its fused form."""
        launch, self._held = self._held, None
        return launch

    def release(self) -> None:
        """Make the launch held back, if one is."""
        if self._held is not None:
            self.take_held()()

    def launch(self, name: str, grid: tuple[int, ...], block: int, args: tuple, smem: int = 0) -> None:
        """Enqueue kernel `name` on the stream (after a launch held back); args are plain ints and
        floats, its parameters in order (params.py has their types)."""
        if self._held is not None:
            self.release()
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        if gx == 0 or gy == 0 or gz == 0:
            return  # nothing to do: empty tensors are legal (e.g. no logits rows in a prefill chunk)
        fn, pack_into, extra, fmt, _ = self._kernels.get(name) or self._kernel(name)
        try:  # the driver copies the buffer during the call (a capture too): one serves every launch
            pack_into(self._args, 0, *args)
        except struct.error as e:
            raise ReflexError(f"internal error: kernel {name}'s arguments {args} do not fit its parameters {fmt}: {e}") from None
        config = self._config if self.overlap_launches else None
        if config is None:
            self.drv.cuLaunchKernel(fn, gx, gy, gz, block, 1, 1, smem, self.stream, None, extra)
            return
        config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX, config.sharedMemBytes = gx, gy, gz, block, smem
        self.drv.cuLaunchKernelEx(byref(config), fn, None, extra)

    # -- memory --------------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> int:
        return self.drv.alloc(nbytes)

    def free(self, ptr: int) -> None:
        self.drv.cuMemFree_v2(ptr)

    def free_memory(self) -> int:
        return self.drv.mem_info()[0]

    def upload(self, dst: int, src_address: int, nbytes: int) -> None:
        self.release()  # it may read what the copy overwrites
        self.drv.cuMemcpyHtoDAsync_v2(dst, src_address, nbytes, self.stream)

    def download(self, dst_address: int, src: int, nbytes: int) -> None:
        """Copy to host memory and wait: the stream's work before it is done when this returns."""
        self.release()
        self.drv.cuMemcpyDtoHAsync_v2(dst_address, src, nbytes, self.stream)
        self.synchronize()

    def synchronize(self) -> None:
        self.release()
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
