"""The driver's floor for a cold Python process: what bench/floor.c does, through ctypes and the
standard library only (the least any Python CUDA program pays). Usage: python floor.py KERNEL.cubin"""
import ctypes
import sys
from ctypes import byref, c_int, c_uint64, c_void_p

N = 1024


def main(cubin: str) -> int:
    with open(cubin, "rb") as fh:
        image = fh.read()
    cu = ctypes.CDLL("libcuda.so.1")

    def check(name, *args):
        code = getattr(cu, name)(*args)
        if code:
            raise SystemExit(f"floor: {name} failed: {code}")

    dev, ctx, module, fn, x = c_int(), c_void_p(), c_void_p(), c_void_p(), c_uint64()
    check("cuInit", 0)
    check("cuDeviceGet", byref(dev), 0)
    check("cuDevicePrimaryCtxRetain", byref(ctx), dev)
    check("cuCtxSetCurrent", ctx)
    check("cuModuleLoadData", byref(module), image)
    check("cuModuleGetFunction", byref(fn), module, b"add_one")
    check("cuMemAlloc_v2", byref(x), ctypes.c_size_t(4 * N))
    check("cuMemsetD32_v2", x, ctypes.c_uint(0x40000000), ctypes.c_size_t(N))  # 2.0f
    n = c_int(N)
    args = (c_void_p * 2)(ctypes.addressof(x), ctypes.addressof(n))
    check("cuLaunchKernel", fn, N // 256, 1, 1, 256, 1, 1, 0, None, args, None)
    out = (ctypes.c_float * N)()
    check("cuMemcpyDtoH_v2", out, x, ctypes.c_size_t(4 * N))
    if any(v != 3.0 for v in out):
        raise SystemExit("floor: wrong result")
    print(f"FLOOR_OK result={out[N - 1]:g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
