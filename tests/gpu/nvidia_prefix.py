#!/usr/bin/env python3
"""Finds the NVIDIA pip packages that come with torch (NCCL, cuDNN, cuSPARSELt,
cuDSS, NVSHMEM) and prints, as shell assignments, the paths that
tests/gpu/device_check.sh passes to CMake:

    python3 tests/gpu/nvidia_prefix.py PREFIX      # prints NAME='value' lines

PREFIX/include and PREFIX/lib get links to those packages' headers and
libraries, each library also under its unversioned name (pip ships only
libnccl.so.2, libcudnn.so.9, ...; find_library looks for libnccl.so), so that a
find_library / find_path through CMAKE_PREFIX_PATH finds them too. NCCL_LIBRARY
is the libnccl that libtorch_cuda.so itself loads (ldd), so that Lockstep and
libtorch share one NCCL. Only these packages are linked: the CUDA runtime
packages (nvidia/cu13, ...) stay out, so that the toolkit in /usr/local/cuda
is the only CUDA that CMake sees.
"""
import glob
import os
import re
import shlex
import site
import subprocess
import sys

# header -> (shell name of its include dir, library stem, shell name of the library)
WANTED = {
    "nccl.h": ("NCCL_INCLUDE_DIR", "libnccl", "NCCL_LIBRARY"),
    "cudnn.h": ("CUDNN_INCLUDE_PATH", "libcudnn", "CUDNN_LIBRARY_PATH"),
    "cusparseLt.h": ("CUSPARSELT_INCLUDE_PATH", "libcusparseLt", "CUSPARSELT_LIBRARY_PATH"),
    "cudss.h": ("CUDSS_INCLUDE_PATH", "libcudss", "CUDSS_LIBRARY_PATH"),
    "nvshmem.h": ("NVSHMEM_INCLUDE_DIR", "libnvshmem_host", "NVSHMEM_HOST_LIBRARY"),
}


def roots():
    found = []
    try:
        import torch
        found.append(os.path.dirname(os.path.dirname(torch.__file__)))
    except Exception:  # noqa: BLE001 - a plain listing then
        pass
    extra = [r for r in os.environ.get("LOCKSTEP_NVIDIA_ROOTS", "").split(":") if r]
    for r in extra + site.getsitepackages() + [site.getusersitepackages()]:
        if r not in found:
            found.append(r)
    return [r for r in found if os.path.isdir(os.path.join(r, "nvidia"))]


def torch_nccl():
    """The libnccl that libtorch_cuda.so resolves, or None."""
    try:
        import torch
        lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so")
        out = subprocess.run(["ldd", lib], capture_output=True, text=True, timeout=30).stdout
    except Exception:  # noqa: BLE001
        return None
    m = re.search(r"libnccl\.so[.0-9]*\s+=>\s+(\S+)", out)
    return os.path.realpath(m.group(1)) if m and os.path.exists(m.group(1)) else None


def link(src, dst):
    if not os.path.lexists(dst):
        os.symlink(src, dst)


def main():
    prefix = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "/tmp/lockstep-nvprefix")
    os.makedirs(os.path.join(prefix, "include"), exist_ok=True)
    os.makedirs(os.path.join(prefix, "lib"), exist_ok=True)
    out = {"NVIDIA_PREFIX": prefix}
    for root in roots():
        for header, (inc_name, stem, lib_name) in WANTED.items():
            for h in sorted(glob.glob(os.path.join(root, "nvidia", "*", "include", header))):
                inc = os.path.dirname(h)
                pkg = os.path.dirname(inc)
                if os.path.basename(pkg).startswith("cu") and os.path.basename(pkg)[2:].isdigit():
                    continue  # nvidia/cu13: the CUDA runtime packages
                out.setdefault(inc_name, inc)
                base = header.split(".")[0]
                for f in glob.glob(os.path.join(inc, base + "*")):
                    link(f, os.path.join(prefix, "include", os.path.basename(f)))
                libs = sorted(glob.glob(os.path.join(pkg, "lib", stem + ".so*")), key=len)
                for lib in glob.glob(os.path.join(pkg, "lib", "lib*.so*")):
                    name = os.path.basename(lib)
                    link(lib, os.path.join(prefix, "lib", name))
                    link(lib, os.path.join(prefix, "lib", name.split(".so")[0] + ".so"))
                if libs:
                    out.setdefault(lib_name, libs[0])  # the shortest name: the soname
    nccl = torch_nccl()
    if nccl:
        out["NCCL_LIBRARY"] = nccl
        inc = os.path.join(os.path.dirname(os.path.dirname(nccl)), "include")
        if os.path.exists(os.path.join(inc, "nccl.h")):
            out["NCCL_INCLUDE_DIR"] = inc
    for name, value in out.items():
        print(f"{name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
