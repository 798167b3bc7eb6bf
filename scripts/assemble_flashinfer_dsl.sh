#!/usr/bin/env bash
# On the device: keeps the FlashInfer / CuTe-DSL parts this call carried (.fi07/part_*, from
# scripts/fetch_flashinfer_dsl.sh) under /tmp, where they outlive the call while the machine stays
# warm, and unpacks the tree into /tmp/site_fi07 once every part in .fi07/MANIFEST is there.
# Exit status 0 when the tree is ready, 3 while parts are still missing. Then
#   export PYTHONPATH=/tmp/site_fi07:/tmp/site_fi07/nvidia_cutlass_dsl/dsl_packages
# (the second entry is what the DSL's .pth file would add in a site directory).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
parts=/tmp/fi07_parts
site=/tmp/site_fi07
mkdir -p "$parts"
[ -f .fi07/MANIFEST ] || { echo "no .fi07/MANIFEST: carry it with the parts"; exit 1; }
cp -f .fi07/MANIFEST "$parts/"
for p in .fi07/part_*; do [ -f "$p" ] && cp -f "$p" "$parts/"; done
if [ -f "$site/.complete" ]; then echo "FlashInfer tree ready in $site"; exit 0; fi
missing=0
while read -r sum name; do
  [ "$name" = fi07.tar.xz ] && continue
  [ -f "$parts/$name" ] && echo "$sum  $parts/$name" | sha256sum -c --quiet || { echo "missing $name"; missing=1; }
done <"$parts/MANIFEST"
[ $missing -eq 0 ] || exit 3
cat "$parts"/part_* >/tmp/fi07.tar.xz
grep ' fi07.tar.xz$' "$parts/MANIFEST" | sed 's|fi07.tar.xz|/tmp/fi07.tar.xz|' | sha256sum -c --quiet
rm -rf "$site" && mkdir -p "$site"
tar -xJf /tmp/fi07.tar.xz -C "$site"
rm -f /tmp/fi07.tar.xz
# flashinfer.gdn_prefill imports tvm_ffi, which the packed tree lacks: carry .whl/apache_tvm_ffi
# with the last part.
tvm=$(ls .whl/apache_tvm_ffi-*.whl 2>/dev/null | head -1 || true)
if [ -n "$tvm" ]; then python3 -m pip install -q --no-index --no-deps --target "$site" "$tvm"; else
  echo "warning: no .whl/apache_tvm_ffi-*.whl carried: import flashinfer.gdn_prefill will fail"; fi
touch "$site/.complete"
echo "FlashInfer tree ready in $site ($(du -sh "$site" | cut -f1))"
