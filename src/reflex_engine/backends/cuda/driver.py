"""A small typed ctypes binding to the CUDA driver API (libcuda.so.1): nothing else.

No libcudart, no cuda-python, no numpy: the cold path pays ~3 ms to dlopen the driver and
nothing to import. Every call is checked; a failure raises CudaError naming the call and the
CUresult's name. The library object is injectable so tests can simulate a driver.
"""
from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, byref, c_char, c_char_p, c_float, c_int, c_size_t, c_uint, c_uint64, c_void_p

from ...errors import CudaUnavailable, ReflexError

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INSUFFICIENT_DRIVER = 35
CUDA_ERROR_NO_BINARY_FOR_GPU = 209

ATTR_COMPUTE_CAPABILITY_MAJOR = 75
ATTR_COMPUTE_CAPABILITY_MINOR = 76
ATTR_MULTIPROCESSOR_COUNT = 16

STREAM_NON_BLOCKING = 1
EVENT_DISABLE_TIMING = 2
HOST_REGISTER_READ_ONLY = 8
STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9

CUdeviceptr = c_uint64


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union
    _fields_ = [("id", c_int), ("pad", c_char * 4), ("value", c_int * 16)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint), ("blockDimX", c_uint),
                ("blockDimY", c_uint), ("blockDimZ", c_uint), ("sharedMemBytes", c_uint), ("hStream", c_void_p),
                ("attrs", POINTER(LaunchAttribute)), ("numAttrs", c_uint)]


# name -> argtypes; every function returns a CUresult (int)
_SIGNATURES = {
    "cuInit": (c_uint,),
    "cuDriverGetVersion": (POINTER(c_int),),
    "cuGetErrorName": (c_int, POINTER(c_char_p)),
    "cuDeviceGetCount": (POINTER(c_int),),
    "cuDeviceGet": (POINTER(c_int), c_int),
    "cuDeviceGetName": (c_char_p, c_int, c_int),
    "cuDeviceGetAttribute": (POINTER(c_int), c_int, c_int),
    "cuDevicePrimaryCtxRetain": (POINTER(c_void_p), c_int),
    "cuDevicePrimaryCtxRelease_v2": (c_int,),
    "cuCtxSetCurrent": (c_void_p,),
    "cuCtxSynchronize": (),
    "cuMemGetInfo_v2": (POINTER(c_size_t), POINTER(c_size_t)),
    "cuMemAlloc_v2": (POINTER(CUdeviceptr), c_size_t),
    "cuMemFree_v2": (CUdeviceptr,),
    "cuMemsetD8Async": (CUdeviceptr, ctypes.c_ubyte, c_size_t, c_void_p),
    "cuMemsetD32Async": (CUdeviceptr, c_uint, c_size_t, c_void_p),
    "cuMemcpyHtoDAsync_v2": (CUdeviceptr, c_void_p, c_size_t, c_void_p),
    "cuMemcpyDtoHAsync_v2": (c_void_p, CUdeviceptr, c_size_t, c_void_p),
    "cuMemcpyDtoDAsync_v2": (CUdeviceptr, CUdeviceptr, c_size_t, c_void_p),
    "cuMemHostAlloc": (POINTER(c_void_p), c_size_t, c_uint),
    "cuMemFreeHost": (c_void_p,),
    "cuMemHostRegister_v2": (c_void_p, c_size_t, c_uint),
    "cuMemHostUnregister": (c_void_p,),
    "cuStreamCreate": (POINTER(c_void_p), c_uint),
    "cuStreamSynchronize": (c_void_p,),
    "cuStreamDestroy_v2": (c_void_p,),
    "cuEventCreate": (POINTER(c_void_p), c_uint),
    "cuEventRecord": (c_void_p, c_void_p),
    "cuEventSynchronize": (c_void_p,),
    "cuEventDestroy_v2": (c_void_p,),
    "cuEventElapsedTime": (POINTER(c_float), c_void_p, c_void_p),
    "cuModuleLoadData": (POINTER(c_void_p), c_void_p),
    "cuModuleUnload": (c_void_p,),
    "cuModuleGetFunction": (POINTER(c_void_p), c_void_p, c_char_p),
    "cuFuncSetAttribute": (c_void_p, c_int, c_int),
    "cuLaunchKernel": (c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
                       POINTER(c_void_p), POINTER(c_void_p)),
    "cuLaunchKernelEx": (POINTER(LaunchConfig), c_void_p, POINTER(c_void_p), POINTER(c_void_p)),
    "cuStreamBeginCapture_v2": (c_void_p, c_int),
    "cuStreamEndCapture": (c_void_p, POINTER(c_void_p)),
    "cuGraphInstantiateWithFlags": (POINTER(c_void_p), c_void_p, ctypes.c_ulonglong),
    "cuGraphLaunch": (c_void_p, c_void_p),
    "cuGraphExecDestroy": (c_void_p,),
    "cuGraphDestroy": (c_void_p,),
}
# entry points older drivers lack: the Driver holds them unchecked, None where missing
_OPTIONAL_SIGNATURES = {
    "cuFuncGetParamInfo": (c_void_p, c_size_t, POINTER(c_size_t), POINTER(c_size_t)),  # CUDA 12.4
}


# Context creation sets up a hardware work queue per connection, ~7 ms each on an H200 (8 by
# default); the engine's one compute stream needs one, and copies on other streams still overlap
# its kernels with a single copy queue. Defaults only: a variable already set is left alone.
DRIVER_ENVIRONMENT = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "CUDA_DEVICE_MAX_COPY_CONNECTIONS": "1"}


def configure_driver_environment() -> None:
    """Set DRIVER_ENVIRONMENT's defaults; call before the driver initialises, on the main thread."""
    for name, value in DRIVER_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


class CudaError(ReflexError):
    """A driver call failed; `code` is the CUresult."""

    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"CUDA driver call {call} failed: {name} ({code})")
        self.call, self.code = call, code


def load_library(name: str = "libcuda.so.1"):
    try:
        return ctypes.CDLL(name)
    except OSError:
        raise CudaUnavailable(f"no NVIDIA driver on this machine ({name} not found); use --device cpu") from None


class Driver:
    """The driver functions as checked methods: `drv.cuMemAlloc_v2(byref(ptr), n)`."""

    def __init__(self, lib):
        self._lib = lib
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            if isinstance(fn, ctypes._CFuncPtr):
                fn.argtypes, fn.restype = argtypes, c_int
            setattr(self, name, self._checked(name, fn))
        for name, argtypes in _OPTIONAL_SIGNATURES.items():
            fn = getattr(lib, name, None)
            if isinstance(fn, ctypes._CFuncPtr):
                fn.argtypes, fn.restype = argtypes, c_int
            setattr(self, name, fn)

    def _checked(self, name: str, fn):
        def call(*args):
            code = fn(*args)
            if code != CUDA_SUCCESS:
                raise CudaError(name, code, self.error_name(code))

        call.__name__ = name
        return call

    def error_name(self, code: int) -> str:
        out = c_char_p()
        if self._lib.cuGetErrorName(code, byref(out)) != CUDA_SUCCESS or not out.value:
            return "CUDA_ERROR_UNKNOWN"
        return out.value.decode()

    def init(self) -> None:
        """cuInit, its refusals as the errors a user can act on; a second call is harmless."""
        try:
            self.cuInit(0)
        except CudaError as e:
            if e.code == CUDA_ERROR_NO_DEVICE:
                raise CudaUnavailable("no CUDA GPU found (the NVIDIA driver is installed but sees no device); use --device cpu") from None
            if e.code == CUDA_ERROR_INSUFFICIENT_DRIVER:
                raise ReflexError("the NVIDIA driver is too old for this machine's CUDA runtime (cuInit: CUDA_ERROR_INSUFFICIENT_DRIVER)") from None
            raise

    # -- the few calls that return values, as functions ---------------------------------------

    def version(self) -> int:
        v = c_int()
        self.cuDriverGetVersion(byref(v))
        return v.value

    def attribute(self, attr: int, device: int) -> int:
        v = c_int()
        self.cuDeviceGetAttribute(byref(v), attr, device)
        return v.value

    def device_name(self, device: int) -> str:
        buf = ctypes.create_string_buffer(256)
        self.cuDeviceGetName(buf, 256, device)
        return buf.value.decode(errors="replace")

    def mem_info(self) -> tuple[int, int]:
        free, total = c_size_t(), c_size_t()
        self.cuMemGetInfo_v2(byref(free), byref(total))
        return free.value, total.value

    def alloc(self, nbytes: int) -> int:
        ptr = CUdeviceptr()
        self.cuMemAlloc_v2(byref(ptr), max(nbytes, 1))
        return ptr.value

    def param_layout(self, fn, limit: int) -> list[tuple[int, int]] | None:
        """(offset, size) in bytes of each of a kernel's parameters, as the kernel itself has them,
        asking for at most `limit`; None where the driver cannot say (older than CUDA 12.4, an
        error, or no parameter at all)."""
        query = self.cuFuncGetParamInfo
        if query is None:
            return None
        offset, size, layout = c_size_t(), c_size_t(), []
        for i in range(limit):
            code = query(fn, i, byref(offset), byref(size))
            if code == CUDA_ERROR_INVALID_VALUE:  # past the last parameter
                break
            if code != CUDA_SUCCESS:
                return None
            layout.append((offset.value, size.value))
        return layout or None


def hold_primary_context(drv: Driver, ordinal: int = 0) -> int | None:
    """Make device `ordinal`'s primary context now and hold it: the device to give to
    cuDevicePrimaryCtxRelease_v2, or None where the device cannot be had (Device then says why)."""
    dev, ctx = c_int(), c_void_p()
    try:
        drv.cuDeviceGet(byref(dev), ordinal)
        drv.cuDevicePrimaryCtxRetain(byref(ctx), dev.value)
    except CudaError:
        return None
    return dev.value


def version_text(v: int) -> str:
    """cuDriverGetVersion's 12040 -> '12.4'."""
    return f"{v // 1000}.{v % 1000 // 10}"
