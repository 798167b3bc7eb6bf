"""The first call's one-time work (kernel loading, shared-memory limits) done ahead by
qla.prepare_cuda_device() or at import: afterwards every kernel still launches, in both
dtypes, forward and backward. Each case runs in a fresh process, since the work happens once
per process and device. Without a Hopper GPU, prepare_cuda_device() is a clear error."""
import os
import subprocess
import sys

import pytest
import torch

import qla

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9

# Forward and backward in bf16 and fp16, each against the exact CPU backend.
_CALLS = """
import torch, torch.nn.functional as F
def rel(a, b):
    return ((a.double().cpu() - b.double()).norm() / b.double().norm()).item()
for dt in (torch.bfloat16, torch.float16):
    gen = torch.Generator().manual_seed(0)
    T, H, HV = 200, 2, 4
    q = F.normalize(torch.randn(1, T, H, 128, generator=gen), dim=-1).to(dt)
    k = F.normalize(torch.randn(1, T, H, 128, generator=gen), dim=-1).to(dt)
    v = torch.randn(1, T, HV, 128, generator=gen).to(dt)
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen)) / 16
    beta = torch.rand(1, T, HV, generator=gen)
    do = torch.randn(1, T, HV, 128, generator=gen).to(dt)
    cpu = [t.float() for t in (q, k, v, g, beta)]
    o, _ = qla.chunk_gated_delta_rule_fwd(*(t.cuda() for t in (q, k, v, g, beta)))
    ro, _ = qla.chunk_gated_delta_rule_fwd(*cpu)
    grads = qla.chunk_gated_delta_rule_bwd(*(t.cuda() for t in (q, k, v, g, beta, do)), None)
    rgrads = qla.chunk_gated_delta_rule_bwd(*cpu, do.float(), None)
    torch.cuda.synchronize()
    errs = [rel(o, ro)] + [rel(a, b) for a, b in zip(grads[:5], rgrads[:5])]
    assert max(errs) < 1e-2, (dt, errs)
print("ok")
"""


def _run(prelude: str, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    out = subprocess.run([sys.executable, "-c", prelude + _CALLS], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")
def test_prepare_cuda_device_then_every_kernel_runs():
    # Imported before CUDA exists (nothing done at import), then prepared explicitly, twice.
    _run("import qla, torch\nassert not torch.cuda.is_initialized()\ntorch.zeros(1, device='cuda')\n"
         "qla.prepare_cuda_device()\nqla.prepare_cuda_device()\n")


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")
def test_import_after_cuda_prepares_and_every_kernel_runs():
    _run("import torch\ntorch.zeros(1, device='cuda')\nimport qla\n")


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")
def test_no_preparation_at_all_still_runs():
    _run("import torch\ntorch.zeros(1, device='cuda')\nimport qla\n", {"QLA_PREPARE_AT_IMPORT": "0"})


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")
def test_cuda_initialisation_with_qla_imported_creates_no_context():
    # torch.cuda.init() runs qla's hook (its runtime starts); no device may get a context.
    code = ("import qla, torch\ntorch.cuda.init()\nassert torch.cuda.is_initialized()\n"
            "live = [d for d in range(torch.cuda.device_count()) if torch._C._cuda_hasPrimaryContext(d)]\n"
            "assert not live, live\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no GPU is present")
def test_prepare_cuda_device_without_a_gpu_is_a_clear_error():
    expected = r"no CUDA device" if qla.has_cuda_backend() else r"no CUDA backend"
    with pytest.raises(ValueError, match=expected):
        qla.prepare_cuda_device()
