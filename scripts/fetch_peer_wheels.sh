#!/usr/bin/env bash
# Fetches the pinned peer packages (FLA Triton, FlashQLA + TileLang, FlashInfer) for the
# device machine, which has no network, and packs them into .whl/ (git-ignored) so that a
# device call can carry them (the working tree that travels is limited to 64 MiB).
#
#   scripts/fetch_peer_wheels.sh            # -> .whl/ (about 58 MiB), sources in .whl_src/
#
# The device already has torch 2.11.0+cu130, triton 3.6.0, Python 3.12, numpy, einops,
# transformers, cloudpickle, ml-dtypes, psutil, tqdm, typing-extensions, jinja2, ninja,
# nvidia-ml-py, click, tabulate, requests, packaging, filelock, cuda-bindings; only what is
# missing is fetched. Everything is installed with --no-deps.
#
# What goes to .whl/ (carried):
#   nvidia_cutlass 4.2.0.0                              CUTLASS/CuTe headers to build QLA on the device
#   nanobind 2.10.2, scikit_build_core 0.11.6           the pinned build tools: the device's own
#                                                       (nanobind 3.1.0 on 2026-12-05) are not ours
#   fla_core 0.6.0, flash_linear_attention 0.6.0       FLA (pure Python, Triton kernels)
#   flash_qla 0.1.3                                     FlashQLA (pure Python, TileLang kernels)
#   apache_tvm_ffi 0.1.12                               needed by tilelang (<0.1.13) and flashinfer
#   flashinfer_python 0.6.13                            FlashInfer; its SM90 GDN prefill is a CUTLASS
#                                                       C++ kernel JIT-compiled with nvcc on first use
#   tilelang_z3.tar.xz                                  tilelang 0.1.15 + z3-solver 4.15.4.0 installed
#                                                       tree (libtvm_compiler.so needs libz3.so.4.15),
#                                                       xz-packed: as wheels they are 79 MB, too big.
# Not carried: torch-c-dlpack-ext (torch 2.11 has the DLPack C exchange API itself), the z3
# command-line binary, the duplicate libz3.so (a symlink instead).
# Newer FlashInfer (>= 0.6.14, 0.7.x) runs SM90 GDN prefill as a CuTe-DSL kernel and needs
# nvidia-cutlass-dsl-libs-cu13 (92 MB wheel, ~63 MB xz-packed): it cannot travel in one call.
#
# On the device, at the start of a command that names .whl in `carry`:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && python3 -c "import tarfile; \
#     tarfile.open('.whl/tilelang_z3.tar.xz').extractall('/tmp/site')" \
#     && export PYTHONPATH=/tmp/site || exit
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_wheels.sh"
wheel_dirs whl  # out=.whl (carried), src=.whl_src

# name==version  sha256 of the wheel pip picks for the device (PLAT in device_wheels.sh)
pins=(
  "fla-core==0.6.0 b0708b70e0b119cd58a0a5146ea56cb175cef6ed969d8ac60267e3e077ce3ebd"
  "flash-linear-attention==0.6.0 6dec9735f8454523c13553622e98aff30152dde6586b4ac7d88010fbb7a06b5f"
  "flash-qla==0.1.3 4a76f76edfc98e0f161c2f0fee73f7d7267276d954339dec4fb5d2e077aff061"
  "apache-tvm-ffi==0.1.12 dc0acd7eeb0e451d5e3f686af3ba0b495fdbf97b5b54cf9a0f770cdafe0e691a"
  "flashinfer-python==0.6.13 239e6ddc3cbbaf0bee251861a8c7c69438b1171830d69ddfa133ddea4494850d"
  "tilelang==0.1.15 ca021a3450ad84b8fe7deb1b659c8d3d2e4b0855fdb59e2992a5349acf019881"
  "z3-solver==4.15.4.0 7e103a6f203f505b8b8b8e5c931cc407c95b61556512d4921c1ddc0b3f41b08e"
  "nvidia-cutlass==4.2.0.0 f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6"
  "nanobind==2.10.2 6976c1b04b90481d2612b346485a3063818c6faa5077fe9d8bbc9b5fbe29c380"
  "scikit-build-core==0.11.6 ce6d8fe64e6b4c759ea0fb95d2f8a68f60d2df31c2989838633b8ec930736360"
)

fetch_pinned "${pins[@]}"

# Carried as wheels.
for name in fla_core-0.6.0 flash_linear_attention-0.6.0 flash_qla-0.1.3 \
            apache_tvm_ffi-0.1.12 flashinfer_python-0.6.13 nvidia_cutlass-4.2.0.0 \
            nanobind-2.10.2 scikit_build_core-0.11.6; do
  cp -f "$src"/"$name"-*.whl "$out"/
done

# tilelang + z3: install the tree for the device's Python, trim, pack with xz.
if [ ! -f "$out/tilelang_z3.tar.xz" ] || [ "${REPACK:-0}" = 1 ]; then
  stage="$(mktemp -d)"
  trap 'rm -rf "$stage"' EXIT
  python3 -m pip install -q --no-compile --target "$stage/site" \
    --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    "$src"/tilelang-0.1.15-*.whl "$src"/z3_solver-4.15.4.0-*.whl
  rm -rf "$stage/site/bin"                      # the z3 command-line binary
  find "$stage/site" -name '__pycache__' -type d -prune -exec rm -rf {} +
  lib="$stage/site/z3/lib"
  if [ -f "$lib/libz3.so" ] && cmp -s "$lib/libz3.so" "$lib/libz3.so.4.15"; then
    rm "$lib/libz3.so"; ln -s libz3.so.4.15 "$lib/libz3.so"
  fi
  (cd "$stage/site" && tar --sort=name --owner=0 --group=0 --numeric-owner \
      --mtime='2026-01-01 00:00:00' -cf - .) | xz -T"${XZ_THREADS:-1}" -6 >"$out/tilelang_z3.tar.xz.tmp"
  mv "$out/tilelang_z3.tar.xz.tmp" "$out/tilelang_z3.tar.xz"
fi

ls -l "$out"
du -cb "$out"/* | tail -1 | awk '{printf "carried total: %.1f MiB\n", $1 / 1048576}'
