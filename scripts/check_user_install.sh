#!/usr/bin/env bash
# Builds and installs QLA the way a user does, and fails when that breaks (a build
# requirement missing from pyproject.toml, a file the build needs left untracked, a wheel
# without its kernels). Run by scripts/test.sh; needs PyPI (pip's isolated build environment
# is filled from it) and an installed torch, which the fresh environments reuse.
#
#   1. a clean copy of the tree (tracked and not-ignored files: no build/ folder, no caches);
#   2. source install: a fresh virtual environment, `pip install <copy>` (isolated build),
#      `import qla`, one small call checked against the fp64 reference;
#   3. wheel: `pip wheel <copy>`; where nvcc exists, its extension must hold sm_90a machine
#      code for both sm90 translation units (HGMMA, Hopper's wgmma, in the SASS) and no PTX,
#      so that the driver never compiles anything at load;
#   4. that wheel installed into a second fresh environment whose PATH holds nothing but the
#      environment itself (no compiler can run), then `import qla` and the small call;
#   5. `pip install <copy>` with no nvcc on PATH: the CPU backend alone, has_cuda_backend()
#      False, the small call.
#
#   QLA_USER_INSTALL_DIR=/some/dir keeps the copy, environments and wheel for a look.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py=${PYTHON:-python3}

work=${QLA_USER_INSTALL_DIR:-$(mktemp -d)}
[[ -n ${QLA_USER_INSTALL_DIR:-} ]] || trap 'rm -rf "$work"' EXIT
rm -rf "$work/src" "$work/venv_src" "$work/venv_whl" "$work/venv_cpu" "$work/wheelhouse"
mkdir -p "$work/src" "$work/wheelhouse"

echo "== user install: clean copy of the tree in $work/src"
git -C "$root" ls-files -z --cached --others --exclude-standard \
  | (cd "$root" && tar --null -T - -cf -) | tar -xf - -C "$work/src"

# One small CPU call against the fp64 reference: proves the extension loads and computes.
smoke='
import os, sys, torch, qla
from qla import reference
assert qla.__file__.startswith(sys.prefix + os.sep), f"imported {qla.__file__}, not the copy installed in {sys.prefix}"
g = torch.Generator().manual_seed(0)
B, T, H, HV, D = 1, 80, 2, 4, 32
q = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
v = torch.randn(B, T, HV, D, generator=g)
gate = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, generator=g)) / 8
beta = torch.rand(B, T, HV, generator=g)
o, ht = qla.chunk_gated_delta_rule(q, k, v, gate, beta, output_final_state=True)
ro, rht = reference.chunked(*(t.double() for t in (q, k, v, gate, beta)))
err = max(((o.double() - ro).norm() / ro.norm()).item(), ((ht.double() - rht).norm() / rht.norm()).item())
assert err < 1e-5, f"rel-L2 {err:.2e} against the fp64 reference"
expect = os.environ["QLA_EXPECT_CUDA"] == "1"
assert qla.has_cuda_backend() == expect, f"has_cuda_backend() is {qla.has_cuda_backend()}, expected {expect}"
print(f"qla {qla.__version__} from {qla.__file__}: CUDA backend {qla.has_cuda_backend()}, rel-L2 {err:.1e}")
'
# The build compiles the sm90 backend exactly when it finds nvcc (CUDACXX or PATH).
if [[ -n ${CUDACXX:-} ]] || command -v nvcc >/dev/null; then with_nvcc=1; else with_nvcc=0; fi

# A fresh environment that reuses the installed torch: torch's site-packages folder is put on
# its path by a .pth line. (Not --system-site-packages: that would also run the .pth hooks
# there, such as a developer's editable install of qla, which would then shadow the copy
# under test.)
torch_site=$("$py" -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
fresh_env() {
  "$py" -m venv "$1"
  local site
  site=$("$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$torch_site" > "$site/reuse_installed_torch.pth"
}

echo "== user install: pip install . in a fresh virtual environment"
fresh_env "$work/venv_src"
"$work/venv_src/bin/python" -m pip install -q --disable-pip-version-check "$work/src"
(cd "$work" && QLA_EXPECT_CUDA=$with_nvcc "$work/venv_src/bin/python" -c "$smoke")

echo "== user install: pip wheel ."
"$work/venv_src/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/wheelhouse" "$work/src"
wheel=$(ls "$work"/wheelhouse/qla-*.whl)
echo "wheel: $(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB)"
"$py" "$root/scripts/check_wheel.py" "$wheel"

echo "== user install: the wheel in a fresh environment with no compiler on PATH"
fresh_env "$work/venv_whl"
# --no-index: nothing is fetched; torch must come from the reused installation.
env -i HOME="$work" PATH="$work/venv_whl/bin" "$work/venv_whl/bin/python" -m pip install -q \
  --disable-pip-version-check --no-index "$wheel"
(cd "$work" && env -i HOME="$work" PATH="$work/venv_whl/bin" QLA_EXPECT_CUDA=$with_nvcc \
   "$work/venv_whl/bin/python" -c "$smoke")

echo "== user install: pip install . where no nvcc is on PATH (the CPU backend alone)"
cpu_path="$work/venv_cpu/bin:/usr/bin:/bin"
if PATH=$cpu_path command -v nvcc >/dev/null; then cpu_nvcc=1; else cpu_nvcc=0; fi
fresh_env "$work/venv_cpu"
env -u CUDACXX PATH="$cpu_path" "$work/venv_cpu/bin/python" -m pip install -q --disable-pip-version-check "$work/src"
(cd "$work" && env -u CUDACXX PATH="$cpu_path" QLA_EXPECT_CUDA=$cpu_nvcc "$work/venv_cpu/bin/python" -c "$smoke")
echo "user install: ok"
