#!/usr/bin/env bash
# Packs the current FlashInfer (its SM90 GDN prefill is a CuTe-DSL kernel, with its own sequence
# splitting) for the device machine, which has no network, in parts that travel in consecutive
# calls: a call's working tree is limited to 64 MiB, and the DSL alone is 69 MB xz-packed.
#
#   scripts/fetch_flashinfer_dsl.sh        # -> .fi07/part_00, part_01, MANIFEST (git-ignored)
#
# The pinned wheels (checked by sha256) are installed for the device's Python 3.12 into a staging
# tree with --no-deps: flashinfer-python without data/csrc, data/cutlass and data/cccl (326 MB of
# C++ sources and headers for its nvcc-built kernels, which the CuTe-DSL GDN prefill does not
# use), nvidia-cutlass-dsl with its base, core and cu13 libraries, and cuda-tile and protobuf,
# which some FlashInfer modules import. The tree is packed with xz (78 MB) and split in two.
#
# On the device, each call carries one part (carry [".fi07/part_00", ".fi07/MANIFEST"], then
# [".fi07/part_01", ".fi07/MANIFEST", "dist", ".whl/apache_tvm_ffi-0.1.12-cp312-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"]
# on the still warm machine) and runs
#   bash scripts/assemble_flashinfer_dsl.sh && export PYTHONPATH=/tmp/site_fi07:/tmp/site_fi07/nvidia_cutlass_dsl/dsl_packages
# which keeps the parts under /tmp and unpacks once all are there (bench/PEERS.md).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_wheels.sh"
wheel_dirs fi07  # out=.fi07 (the parts), src=.fi07_src
pins=(
  "flashinfer-python==0.7.2.post1 bfdc18b9e1e4d8d0730fe4343dc0e284cd0c160086de80f99888bc4867922d49"
  "nvidia-cutlass-dsl==4.8.1 43ed46b21d151aa643c6765457c7310827b938c1cf45d5109a0152de4ef06227"
  "nvidia-cutlass-dsl-libs-base==4.8.1 ac2fd8c7fa3d6ded00917fa7cba8686061005da8c4703c6a29e03c1504543909"
  "nvidia-cutlass-dsl-libs-core==4.8.1 bacc6760e3286db447d45720d32ae58ac2e6cecade1152345ef784b2d5e44431"
  "nvidia-cutlass-dsl-libs-cu13==4.8.1 50191a381d8cc1393373ae0bc879b0aefa9a256c23c22d4fa1c2fe3dfe57bc90"
  "cuda-tile==1.7.0 -"
  "protobuf==7.36.2 -"
)
fetch_pinned "${pins[@]}"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
python3 -m pip install -q --no-compile --target "$stage/site" "${PLAT[@]}" "${WHEELS[@]}"
rm -rf "$stage/site/flashinfer/data/csrc" "$stage/site/flashinfer/data/cutlass" "$stage/site/flashinfer/data/cccl" \
       "$stage/site/bin"
find "$stage/site" -name '__pycache__' -type d -prune -exec rm -rf {} +
(cd "$stage/site" && tar --sort=name --owner=0 --group=0 --numeric-owner --mtime='2026-01-01 00:00:00' -cf - .) \
  | xz -T"${XZ_THREADS:-2}" -6 >"$stage/fi07.tar.xz"
rm -f "$out"/part_*
split -n "${PARTS:-2}" -d "$stage/fi07.tar.xz" "$out/part_"  # two calls: ~39 MB each
(cd "$out" && sha256sum part_* >MANIFEST && sha256sum "$stage/fi07.tar.xz" | sed 's|  .*|  fi07.tar.xz|' >>MANIFEST)
ls -l "$out"
