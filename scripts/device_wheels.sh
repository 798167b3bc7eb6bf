# Sourced by the scripts that fetch packages for the device machine (no network there):
# scripts/fetch_peer_wheels.sh and scripts/fetch_flashinfer_dsl.sh.
#   wheel_dirs NAME       out=<root>/.NAME, src=<root>/.NAME_src, both created and git-ignored
#   fetch_pinned PIN...   each "name==version sha256" (sha256 "-": unchecked) downloaded for the
#                         device's Python into $src; the wheel paths in WHEELS
# PLAT: pip's arguments for the device (Python 3.12, manylinux x86-64, binary wheels, no deps).
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PLAT=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

wheel_dirs() {
  out="$root/.$1"
  src="$root/.$1_src"
  mkdir -p "$out" "$src"
  local exclude="$root/.git/info/exclude" p
  if [ -d "$root/.git" ]; then
    mkdir -p "$(dirname "$exclude")"
    for p in "/.$1/" "/.$1_src/"; do grep -qxF "$p" "$exclude" 2>/dev/null || echo "$p" >>"$exclude"; done
  fi
}

fetch_pinned() {
  WHEELS=()
  local entry spec sha name ver whl
  for entry in "$@"; do
    spec="${entry% *}"; sha="${entry#* }"
    python3 -m pip download -q "${PLAT[@]}" -d "$src" "$spec"
    name="${spec%%==*}"; ver="${spec#*==}"
    whl=$(ls "$src"/"${name//-/_}"-"$ver"-*.whl)
    [ "$sha" = "-" ] || echo "$sha  $whl" | sha256sum -c --quiet
    WHEELS+=("$whl")
  done
}
