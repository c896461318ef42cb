"""A libcuda for machines without a GPU: every driver call answered at once, so everything above
the ctypes binding (Device, CudaOps, the engine) runs for real and only the kernels do not.

The kernels' parameter tables come from their C signatures in kernels/*.cu (`kernel_formats`),
reported through cuFuncGetParamInfo as a CUDA 12.4+ driver reports them, and every launch's
arguments are checked against them: one packed buffer of exactly the table's size through
`extra` (kernelParams NULL). With `launches` set to a list, each launch is recorded there as
(kernel, grid, block, shared bytes, whether through cuLaunchKernelEx, each argument's bytes), from a packed buffer or from an
array of argument addresses alike, so recordings of two versions of the host code compare.
"""
from __future__ import annotations

import ctypes
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "src", "reflex_engine", "kernels")
NAMES = {1: b"CUDA_ERROR_INVALID_VALUE", 2: b"CUDA_ERROR_OUT_OF_MEMORY", 100: b"CUDA_ERROR_NO_DEVICE",
         712: b"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", 801: b"CUDA_ERROR_NOT_SUPPORTED"}
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712

# a kernel parameter's C type -> its letter (the struct module's), for types passed by value
_SCALARS = {"int": "i", "int32_t": "i", "unsigned": "I", "unsigned int": "I", "uint32_t": "I", "int64_t": "q",
            "long long": "q", "uint64_t": "Q", "size_t": "Q", "float": "f", "double": "d"}
SIZES = {"P": 8, "i": 4, "I": 4, "q": 8, "Q": 8, "f": 4, "d": 8}
_DEFINE = re.compile(r"\s*#\s*define\s+(\w+)\(([^)]*)\)(.*)")
_PARAMS = re.compile(r"\s*#\s*define\s+([A-Z][A-Z0-9_]*_PARAMS)\s+(.*)")  # a list of parameters (rope.cuh ROPE_OUT_PARAMS)
# an attribute macro (attention.cu's ATTN_CLUSTER_DIMS: a cluster's shape where the architecture has them) may
# come before the launch bounds
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:[A-Z][A-Z0-9_]*\s+)?(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?'
                     r"(\w+)\s*\(([^)]*)\)")


def kernel_formats(kernels_dir: str = KERNELS) -> dict[str, str]:
    """Every extern "C" kernel of the .cu/.cuh files -> its parameters' letters: P for a pointer,
    i/I int/unsigned, q/Q 64-bit, f float, d double. Function-like macros (the per-quant-type
    families, KERNEL_TYPES(X)) are expanded as the preprocessor would for these files."""
    defines: dict[str, tuple[list[str], str]] = {}
    constants: dict[str, str] = {}
    lines: list[str] = []
    for name in sorted(os.listdir(kernels_dir)):
        if not name.endswith((".cu", ".cuh")):
            continue
        with open(os.path.join(kernels_dir, name)) as fh:
            src = fh.read()
        src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
        src = re.sub(r"//[^\n]*", "", src).replace("\\\n", " ")
        for line in src.splitlines():
            m = _DEFINE.match(line)
            constant = None if m else _PARAMS.match(line)
            if m:
                defines[m[1]] = ([p.strip() for p in m[2].split(",")], m[3])
            elif constant:
                constants[constant[1]] = constant[2]
            elif not line.lstrip().startswith("#"):
                lines.append(line)
    call = re.compile(r"\b(" + "|".join(map(re.escape, defines)) + r")\(([^()]*)\)") if defines else None

    def expand(text: str, depth: int = 0) -> str:
        if call is None or depth > 8:
            return text

        def one(m: re.Match) -> str:
            params, body = defines[m[1]]
            for p, a in zip(params, (a.strip() for a in m[2].split(","))):
                body = re.sub(rf"\b{re.escape(p)}\b", a, body)
            return expand(re.sub(r"\s*##\s*", "", body), depth + 1)

        return call.sub(one, text)

    text = expand("\n".join(lines))
    for name, body in constants.items():
        text = re.sub(rf"\b{name}\b", body, text)
    found: dict[str, str] = {}
    for m in _KERNEL.finditer(text):
        params = [p.strip() for p in m[2].split(",") if p.strip() and p.strip() != "void"]
        found[m[1]] = "".join(_letter(m[1], p) for p in params)
    return found


def _letter(kernel: str, param: str) -> str:
    if "*" in param:
        return "P"
    words = [w for w in param.split() if w not in ("const", "volatile", "__restrict__")][:-1]  # the last is its name
    letter = _SCALARS.get(" ".join(words))
    if letter is None:
        raise ValueError(f"kernel {kernel}: parameter {param!r} of a type fake_libcuda does not know")
    return letter


def natural_layout(fmt: str) -> list[tuple[int, int]]:
    """(offset, size) of each parameter, each at a multiple of its own size (the C ABI's)."""
    out, end = [], 0
    for letter in fmt:
        size = SIZES[letter]
        end = -(-end // size) * size
        out.append((end, size))
        end += size
    return out


class FakeLibcuda:
    """Answers the driver API the way a machine with these properties would. param_info: whether
    cuFuncGetParamInfo exists (a CUDA 12.4+ driver); param_info_error: the CUresult it returns
    instead of answering (a driver that has the symbol but will not say)."""

    def __init__(self, init_error=0, version=13000, capability=(9, 0), free=80 << 30, param_info=True,
                 param_info_error=0, kernels_dir=KERNELS):
        self.init_error, self.version, self.capability, self.free = init_error, version, capability, free
        self.allocated = 0
        self.formats = kernel_formats(kernels_dir)
        self.layouts: dict[str, list[tuple[int, int]]] = {}  # a kernel's (offset, size) table other than the natural one
        self.functions: list[str] = []  # a CUfunction is its index here + 1
        self.launches: list | None = None  # set to a list to record every launch
        self.param_info, self.param_info_error = param_info, param_info_error
        self._host: dict[int, object] = {}  # pinned host allocations, kept alive, by address
        self.live: dict[int, int] = {}  # device allocations not freed: address -> bytes
        self.registered: dict[int, int] = {}  # start -> bytes of each host range registered (pinned) and not unregistered
        self.pinned_twice = 0  # registrations refused because a page of theirs was pinned already
        self._events_made = 0
        self.contexts = 0  # holds on the primary context: retains less releases

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "cuFuncGetParamInfo":
            if not self.__dict__.get("param_info", True):
                raise AttributeError(name)  # a driver older than CUDA 12.4
            return self._param_info
        return lambda *args: 0  # calls whose results these tests don't look at succeed

    def cuInit(self, flags):
        return self.init_error

    def cuEventCreate(self, out, flags):
        self._events_made += 1
        out._obj.value = self._events_made  # distinct, as a driver's handles are
        return 0

    def cuGetErrorName(self, code, out):
        out._obj.value = NAMES.get(code, b"CUDA_ERROR_UNKNOWN")
        return 0

    def cuDriverGetVersion(self, out):
        out._obj.value = self.version
        return 0

    def cuDeviceGetCount(self, out):
        out._obj.value = 1
        return 0

    def cuDeviceGetName(self, buf, size, dev):
        ctypes.memmove(buf, b"Fake GPU\0", 9)
        return 0

    def cuDeviceGetAttribute(self, out, attr, dev):
        from reflex_engine.backends.cuda import driver

        out._obj.value = {driver.ATTR_COMPUTE_CAPABILITY_MAJOR: self.capability[0],
                          driver.ATTR_COMPUTE_CAPABILITY_MINOR: self.capability[1]}.get(attr, 132)
        return 0

    def cuMemGetInfo_v2(self, free, total):
        free._obj.value, total._obj.value = self.free, 141 << 30
        return 0

    def cuMemAlloc_v2(self, ptr, nbytes):
        ptr._obj.value = (1 << 40) + self.allocated  # distinct addresses, so recordings tell buffers apart
        self.live[ptr._obj.value] = nbytes
        self.allocated += -(-nbytes // 4096) * 4096
        return 0

    def cuMemFree_v2(self, ptr):
        return 0 if self.live.pop(ptr, None) is not None else CUDA_ERROR_INVALID_VALUE  # a double free fails

    def cuMemHostAlloc(self, ptr, nbytes, flags):
        buf = ctypes.create_string_buffer(nbytes)
        ptr._obj.value = ctypes.addressof(buf)
        self._host[ptr._obj.value] = buf
        return 0

    def cuMemFreeHost(self, ptr):
        address = ptr.value if isinstance(ptr, ctypes.c_void_p) else ptr
        return 0 if self._host.pop(address, None) is not None else CUDA_ERROR_INVALID_VALUE

    def cuMemHostRegister_v2(self, start, nbytes, flags):
        if any(start < s + n and s < start + nbytes for s, n in self.registered.items()):
            self.pinned_twice += 1
            return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        self.registered[start] = nbytes
        return 0

    def cuMemHostUnregister(self, start):
        return 0 if self.registered.pop(start, None) is not None else CUDA_ERROR_INVALID_VALUE

    def cuDevicePrimaryCtxRetain(self, ctx, device):
        self.contexts += 1
        return 0

    def cuDevicePrimaryCtxRelease_v2(self, device):
        self.contexts -= 1
        return 0

    def cuModuleGetFunction(self, fn, module, name):
        self.functions.append(name.decode())
        fn._obj.value = len(self.functions)
        return 0

    def _param_info(self, fn, index, offset, size):
        if self.param_info_error:
            return self.param_info_error
        layout = self.layout(self._name(fn))
        if index >= len(layout):
            return CUDA_ERROR_INVALID_VALUE
        offset._obj.value, size._obj.value = layout[index]
        return 0

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self._launched(self._name(fn), (gx, gy, gz), (bx, by, bz), smem, False, params, extra)
        return 0

    def cuLaunchKernelEx(self, config, fn, params, extra):
        c = config._obj
        self._launched(self._name(fn), (c.gridDimX, c.gridDimY, c.gridDimZ), (c.blockDimX, c.blockDimY, c.blockDimZ),
                       c.sharedMemBytes, True, params, extra)
        return 0

    def layout(self, name: str) -> list[tuple[int, int]]:
        return self.layouts.get(name) or natural_layout(self.formats[name])

    def _name(self, fn) -> str:
        handle = fn.value if isinstance(fn, ctypes.c_void_p) else fn
        return self.functions[handle - 1]

    def _launched(self, name, grid, block, smem, ex, params, extra) -> None:
        layout = self.layout(name)
        if extra is not None:
            assert params is None, f"{name}: kernelParams and extra both given"
            items = [extra[i] or 0 for i in range(5)]
            assert items[0] == 1 and items[2] == 2 and items[4] == 0, f"{name}: extra is not BUFFER_POINTER, BUFFER_SIZE, END"
            size = ctypes.c_size_t.from_address(items[3]).value
            end = layout[-1][0] + layout[-1][1] if layout else 0
            assert size == end, f"{name}: a {size}-byte argument buffer for parameters of {end} bytes ({self.formats[name]})"
            buf = ctypes.string_at(items[1], size)
            args = tuple(buf[o:o + s] for o, s in layout)
        else:
            args = tuple(ctypes.string_at(params[i], s) for i, (_, s) in enumerate(layout))
        if self.launches is not None:
            self.launches.append((name, tuple(grid), tuple(block), smem, ex, args))
