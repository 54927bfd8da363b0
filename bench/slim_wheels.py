"""Slim the staged GPU wheels to what pdserve's GPU path uses, so one device call can carry them.

    python3 bench/slim_wheels.py [--src .whl] [--dst .whl/slim]

The device call may carry 64 MiB in all; flashinfer-python 0.7.2.post1 is 62 MB zipped (420 MB
unpacked) and nixl-cu13 1.5.1 59 MB. What the GPU path really needs:

* **flashinfer**: every ``*.py`` (``import flashinfer`` imports most subpackages eagerly), the JIT
  sources of the paged batch prefill/decode kernels (the top-level files of ``data/csrc``; its
  sub-folders are MoE, sampling, MLA, sm100/sm120 kernels), flashinfer's own headers
  (``data/include``), and the header trees the JIT adds to its include path (CUTLASS ``include`` +
  ``tools/util/include`` for the sm90 FA3 prefill, the vendored CCCL ``cub``/``thrust``/
  ``libcudacxx``, spdlog). Its Python deps on the device image are already there (torch, numpy,
  ninja, einops, tabulate, nvidia-ml-py, cuda-bindings); only ``apache-tvm-ffi`` (3 MB) must travel.
  The cutlass-dsl / cudnn-frontend / nccl4py / cuda-tile deps are imported lazily by other kernels.
* **nixl**: the Python package, the UCX backend plugin, UCX's CUDA and CMA transport modules, and
  the shared libraries they need (ELF closure); the other backend plugins (GDS, POSIX, object
  stores, libfabric, GPUNETIO, ...), the InfiniBand transports and ``nixl_ep`` are dropped. The
  device has no InfiniBand; a cross-host deployment installs the full wheel.

The outputs are plain wheels (zip, same name) so ``pip install --no-deps --target`` takes them.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import zipfile
from pathlib import Path

FI_KEEP_DIRS = (
    "flashinfer/data/include/",
    "flashinfer/data/spdlog/include/",
    "flashinfer/data/cutlass/include/",
    "flashinfer/data/cutlass/tools/util/include/",
    "flashinfer/data/cccl/cub/cub/",
    "flashinfer/data/cccl/thrust/thrust/",
    "flashinfer/data/cccl/libcudacxx/include/",
)
# NIXL: the Python bindings, the UCX backend plugin and the UCX transport modules that move GPU
# memory on one host (cuda_copy/cuda_ipc live in libuct_cuda, cma for host memory); every shared
# library they need is found by following ELF NEEDED entries (readelf) inside the wheel.
NIXL_SEEDS = (
    "nixl_cu13/_bindings.",
    "nixl_cu13/_utils.",
    ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so",
    "nixl_cu13.libs/ucx/libuct_cuda.so",
    "nixl_cu13.libs/ucx/libucm_cuda.so",
    "nixl_cu13.libs/ucx/libuct_cma.so",
)


def keep_flashinfer(name: str) -> bool:
    if not name.startswith("flashinfer/"):
        return True  # dist-info and the b12x top-level helper package
    if not name.startswith("flashinfer/data/"):
        return name.endswith((".py", "py.typed"))
    if name.startswith(FI_KEEP_DIRS):
        return True
    rest = name.removeprefix("flashinfer/data/")
    if "/" not in rest:
        return rest.endswith(".py")
    top, _, leaf = rest.partition("/")
    return top == "csrc" and "/" not in leaf  # the JIT sources, not their kernel sub-folders


def nixl_closure(whl: Path) -> set[str]:
    """Names inside the wheel of the seed libraries and every library they need, transitively."""
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(whl) as z:
        libs = [n for n in z.namelist() if ".so" in n.rsplit("/", 1)[-1]]
        z.extractall(tmp, members=libs)
        by_base = {n.rsplit("/", 1)[-1]: n for n in libs}
        todo = [n for n in libs if n.startswith(NIXL_SEEDS)]
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            out = subprocess.run(
                ["readelf", "-d", str(Path(tmp) / name)], capture_output=True, text=True, check=True
            ).stdout
            for lib in re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out):
                if lib in by_base:
                    todo.append(by_base[lib])
    return seen


def nixl_keeper(whl: Path):
    libs = nixl_closure(whl)

    def keep(name: str) -> bool:
        if name.startswith("nixl_cu13/") and name.endswith((".py", "py.typed")):
            return True
        return ".dist-info/" in name or name in libs

    return keep


def slim(src: Path, dst: Path, keep) -> tuple[int, int]:
    dst.parent.mkdir(parents=True, exist_ok=True)
    kept = 0
    with (
        zipfile.ZipFile(src) as zin,
        zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout,
    ):
        for info in zin.infolist():
            if info.is_dir() or not keep(info.filename):
                continue
            if info.filename.endswith(".dist-info/RECORD"):
                zout.writestr(info, b"")  # hashes of dropped files would not verify; pip accepts empty
                continue
            zout.writestr(info, zin.read(info.filename))
            kept += 1
    return kept, dst.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=Path(".whl"))
    ap.add_argument("--dst", type=Path, default=Path(".whl/slim"))
    args = ap.parse_args()
    for pattern in ("flashinfer_python-*.whl", "nixl_cu13-*.whl"):
        for whl in sorted(args.src.glob(pattern)):
            keep = keep_flashinfer if pattern.startswith("flashinfer") else nixl_keeper(whl)
            kept, size = slim(whl, args.dst / whl.name, keep)
            print(
                f"{whl.name}: {whl.stat().st_size / 2**20:.1f} MiB -> {size / 2**20:.1f} MiB ({kept} files)"
            )
    # Copied as they are: flashinfer's one missing dependency, the gRPC stack the cluster benchmark
    # needs (the device image may lack it or carry another protobuf than the generated code wants), and
    # the event loop every serving process runs on (pdserve/event_loop.py), and llguidance (structured
    # output, engine/grammar).
    copied = ("apache_tvm_ffi-*.whl", "grpcio*-*.whl", "protobuf-*.whl", "uvloop-*.whl", "llguidance-*.whl")
    for whl in sorted(w for pat in copied for w in args.src.glob(pat)):
        (args.dst / whl.name).write_bytes(whl.read_bytes())
        print(f"{whl.name}: copied ({whl.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
