"""Backends for the benchmark: QLA and its peers behind one interface.

Every factory takes our standard inputs (FLA conventions, B = 1 packed with cu_seqlens):
    q, k  [1, T, H, 128] bf16          v   [1, T, HV, 128] bf16
    g     [1, T, HV] fp32 log-decay    beta [1, T, HV] fp32
    h0    [N, HV, 128, 128] fp32 ([K, V] layout)      cu_seqlens [N + 1] int32 / int64
and returns a zero-argument callable that runs one forward (initial state in, final state
requested, under no_grad) or one backward (given do [1, T, HV, 128] bf16 and dht
[N, HV, 128, 128] fp32), or None, with the reason printed, when the backend cannot run.
Conversions a peer needs (FlashInfer's packed [T, H, D] layout, linear alpha = exp(g),
[V, K] state) are done once, outside the callable, so only the op itself is timed.

Each callable returns the backend's outputs converted back to our conventions through
`.result(out)` helpers (see `to_common`), which the correctness cross-check uses; the
conversion is not part of the timed call.

Environment handling: FLA is imported with FLA_FLASH_QLA=0 and FLA_TILELANG=0 so that its
Triton kernels are what is timed (FLA would otherwise hand the whole op to FlashQLA, and on
Hopper route chunk_bwd_dqkwg to TileLang). FLA's Hopper guard on gated backward with
Triton < 3.7.1 (FLA issue 640) is lifted for timing only; those gradients are not trusted.
"""
from __future__ import annotations

import inspect
import os
import shutil
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

FWD_BACKENDS = ("qla", "fla", "flashqla", "flashinfer")
BWD_BACKENDS = ("qla", "fla", "flashqla")

_reasons: Dict[str, str] = {}


def _skip(name: str, why: str) -> None:
    key = f"{name}: {why}"
    if key not in _reasons:
        _reasons[key] = why
        print(f"[peers] {name} unavailable: {why}", flush=True)
    return None


def set_cache_dirs(root: str) -> None:
    """Point the JIT / autotune caches of Triton, TileLang and FlashInfer below `root`
    (call before the first import of a peer). On a warm device machine a later call then
    reuses what an earlier one compiled."""
    os.makedirs(root, exist_ok=True)
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(root, "triton"))
    os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(root, "tilelang"))
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", os.path.join(root, "flashinfer"))
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))


# --------------------------------------------------------------------------------------
# Imports (lazy; each returns the module or None)
# --------------------------------------------------------------------------------------

def _import_qla():
    try:
        import qla  # noqa: F401
        return qla
    except Exception as e:  # ImportError, or a missing CUDA extension
        return _skip("qla", f"import qla failed: {e!r}")


def _import_fla():
    os.environ["FLA_FLASH_QLA"] = "0"   # do not hand the op to FlashQLA
    os.environ["FLA_TILELANG"] = "0"    # keep chunk_bwd_dqkwg on Triton
    try:
        import fla  # noqa: F401
        from fla.ops.gated_delta_rule import chunk as fla_chunk
        return fla_chunk
    except Exception as e:
        return _skip("fla", f"import fla failed: {e!r}")


def _import_flashqla():
    try:
        import flash_qla
        return flash_qla
    except Exception as e:
        return _skip("flashqla", f"import flash_qla failed: {e!r}")


def _import_flashinfer():
    try:
        import flashinfer.gdn_prefill as fi
        return fi
    except Exception as e:
        return _skip("flashinfer", f"import flashinfer.gdn_prefill failed: {e!r}")


def versions() -> Dict[str, str]:
    """Versions of torch, triton and each importable peer (for the results header)."""
    out = {"torch": torch.__version__}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:
        out["triton"] = "-"
    for name, mod in (("qla", "qla"), ("fla-core", "fla"), ("flash-qla", "flash_qla"),
                      ("tilelang", "tilelang"), ("flashinfer", "flashinfer")):
        try:
            m = __import__(mod)
            out[name] = str(getattr(m, "__version__", "?"))
        except Exception:
            out[name] = "-"
    return out


# --------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------

@dataclass
class Op:
    """A timed op: `fn` is what is timed; `to_common(out)` turns fn's return value into
    (o [1, T, HV, V], final_state [N, HV, K, V]) or, for backward,
    (dq, dk, dv, dg, dbeta, dh0) in our conventions (for cross-checks, not timed)."""
    fn: Callable[[], object]
    to_common: Callable[[object], Tuple[Optional[torch.Tensor], ...]]
    note: str = ""

    def __call__(self):
        return self.fn()


def _identity_pair(out):
    o, ht = out
    return o, ht


def _long(cu: torch.Tensor) -> torch.Tensor:
    return cu if cu.dtype == torch.int64 else cu.to(torch.int64)


# --------------------------------------------------------------------------------------
# QLA
# --------------------------------------------------------------------------------------

def _accepts(fn, name: str) -> bool:
    """Whether `fn` names parameter `name` explicitly (not only through **kwargs)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _host_lengths(fn, cu_seqlens_cpu) -> dict:
    """cu_seqlens_cpu as a keyword for `fn` where given and accepted (older QLA builds lack it)."""
    return {"cu_seqlens_cpu": cu_seqlens_cpu} if cu_seqlens_cpu is not None and _accepts(fn, "cu_seqlens_cpu") else {}


def qla_forward(q, k, v, g, beta, h0, cu_seqlens, *, cu_seqlens_cpu=None, scale=None) -> Optional[Op]:
    qla = _import_qla()
    if qla is None:
        return None
    kwargs = _host_lengths(qla.chunk_gated_delta_rule, cu_seqlens_cpu)

    def fn():
        with torch.no_grad():
            return qla.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                                              output_final_state=True, cu_seqlens=cu_seqlens, **kwargs)

    return Op(fn, _identity_pair, "qla.chunk_gated_delta_rule, no_grad")


def qla_backward(q, k, v, g, beta, h0, cu_seqlens, do, dht, *, cu_seqlens_cpu=None, scale=None) -> Optional[Op]:
    qla = _import_qla()
    if qla is None:
        return None
    bwd = getattr(qla, "chunk_gated_delta_rule_bwd", None)
    if bwd is None:
        return _skip("qla-bwd", "qla.chunk_gated_delta_rule_bwd missing")
    kwargs = _host_lengths(bwd, cu_seqlens_cpu)
    # QLA_BENCH_BWD_SPLIT=1: the fused backward on every row (split=True), to place the
    # dispatch's threshold between it and the chunked backward.
    if os.environ.get("QLA_BENCH_BWD_SPLIT") == "1" and _accepts(bwd, "split"):
        kwargs["split"] = True

    def fn():
        return bwd(q, k, v, g, beta, do, dht, scale=scale, initial_state=h0, cu_seqlens=cu_seqlens, **kwargs)

    return Op(fn, lambda out: tuple(out), "qla.chunk_gated_delta_rule_bwd (recomputes its forward)")


# --------------------------------------------------------------------------------------
# FLA (Triton)
# --------------------------------------------------------------------------------------

def _fla_chunk_indices(cu64: torch.Tensor, cu_cpu=None, chunk_size: int = 64):
    from fla.ops.utils.index import prepare_chunk_indices
    try:
        return prepare_chunk_indices(cu64, chunk_size, cu_seqlens_cpu=cu_cpu)
    except TypeError:
        return prepare_chunk_indices(cu64, chunk_size)


def lift_fla_hopper_guard() -> bool:
    """FLA refuses its gated chunk_bwd_dqkwg on Hopper with Triton >= 3.4 and < 3.7.1
    (FLA issue 640, a Triton miscompile). For timing only, pretend Triton is >= 3.7.1.
    Returns True when the guard existed and was lifted."""
    try:
        import fla.ops.common.chunk_o as chunk_o
    except Exception:
        return False
    if getattr(chunk_o, "TRITON_ABOVE_3_7_1", True):
        return False
    chunk_o.TRITON_ABOVE_3_7_1 = True
    warnings.warn("FLA Hopper guard (issue 640) lifted for timing: FLA gradients are not trusted")
    return True


def fla_forward(q, k, v, g, beta, h0, cu_seqlens, *, cu_seqlens_cpu=None, scale=None) -> Optional[Op]:
    mod = _import_fla()
    if mod is None:
        return None
    cu64 = _long(cu_seqlens)
    ci = _fla_chunk_indices(cu64, cu_seqlens_cpu)

    def fn():
        with torch.no_grad():
            return mod.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                                              output_final_state=True, cu_seqlens=cu64,
                                              chunk_indices=ci)

    return Op(fn, _identity_pair, "fla chunk_gated_delta_rule (Triton; FLA_FLASH_QLA=0 FLA_TILELANG=0), no_grad")


def fla_backward(q, k, v, g, beta, h0, cu_seqlens, do, dht, *, cu_seqlens_cpu=None, scale=None,
                 mode: str = "lowlevel") -> Optional[Op]:
    """mode "lowlevel": fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule_bwd on the
    forward's saved tensors (chunk-cumsum'd g in log2 units, A = the WY inverse), which is
    what FLA's autograd backward calls; "autograd": torch.autograd.grad with retain_graph."""
    mod = _import_fla()
    if mod is None:
        return None
    lift_fla_hopper_guard()
    cu64 = _long(cu_seqlens)
    ci = _fla_chunk_indices(cu64, cu_seqlens_cpu)
    sc = scale if scale is not None else q.shape[-1] ** -0.5

    if mode == "lowlevel" and hasattr(mod, "chunk_gated_delta_rule_fwd") and hasattr(mod, "chunk_gated_delta_rule_bwd"):
        with torch.no_grad():
            g_cum, _o, A, _ht, h0_used, _g_in = mod.chunk_gated_delta_rule_fwd(
                q=q, k=k, v=v, g=g, beta=beta, scale=sc, initial_state=h0, output_final_state=False,
                cu_seqlens=cu64, chunk_indices=ci)

        def fn():
            with torch.no_grad():
                dq, dk, dv, db, dg, dh0, _dA, _ddt = mod.chunk_gated_delta_rule_bwd(
                    q=q, k=k, v=v, g=g_cum, beta=beta, A=A, scale=sc, initial_state=h0_used,
                    do=do, dht=dht, cu_seqlens=cu64, chunk_indices=ci)
            return dq, dk, dv, dg, db, dh0

        return Op(fn, lambda out: tuple(out), "fla chunk_gated_delta_rule_bwd (low-level, guard lifted)")

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta, h0)]
    o, ht = mod.chunk_gated_delta_rule(*leaves[:5], scale=scale, initial_state=leaves[5],
                                       output_final_state=True, cu_seqlens=cu64, chunk_indices=ci)

    def fn():
        dq, dk, dv, dg, db, dh0 = torch.autograd.grad((o, ht), leaves, (do, dht), retain_graph=True)
        return dq, dk, dv, dg, db, dh0

    return Op(fn, lambda out: tuple(out), "fla autograd.grad (retain_graph, guard lifted)")


# --------------------------------------------------------------------------------------
# FlashQLA (TileLang)
# --------------------------------------------------------------------------------------

def flashqla_forward(q, k, v, g, beta, h0, cu_seqlens, *, cu_seqlens_cpu=None, scale=None,
                     auto_cp: bool = True) -> Optional[Op]:
    fq = _import_flashqla()
    if fq is None:
        return None
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return _skip("flashqla", "needs K = V = 128")

    def fn():
        with torch.no_grad():
            return fq.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                                             output_final_state=True, cu_seqlens=cu_seqlens,
                                             auto_cp=auto_cp)

    return Op(fn, _identity_pair, f"flash_qla.chunk_gated_delta_rule(auto_cp={auto_cp}), no_grad")


def flashqla_backward(q, k, v, g, beta, h0, cu_seqlens, do, dht, *, cu_seqlens_cpu=None, scale=None,
                      mode: str = "lowlevel") -> Optional[Op]:
    """mode "lowlevel": flash_qla.chunk_gated_delta_rule_bwd on the forward's (g chunk-cumsum,
    A) with the same intra-card-CP context and forward CP cache that its autograd path uses;
    "autograd": torch.autograd.grad with retain_graph."""
    fq = _import_flashqla()
    if fq is None:
        return None
    sc = scale if scale is not None else q.shape[-1] ** -0.5
    if mode == "lowlevel":
        try:
            from flash_qla.ops.gated_delta_rule import chunk as fq_chunk
            ctx = fq_chunk._auto_intra_cp_context(k, v, cu_seqlens, fq_chunk.CHUNK_SIZE, True, True)
            with torch.no_grad():
                g_cum, A, _o, _h, _ht, cp_cache = fq.chunk_gated_delta_rule_fwd(
                    q, k, v, g, beta, scale=sc, initial_state=h0, cu_seqlens=cu_seqlens,
                    output_final_state=False, auto_cp=True, enable_fwd_cp_cache=True,
                    cp_context=ctx, is_train=True)

            def fn():
                with torch.no_grad():
                    dq, dk, dv, db, dg, dh0 = fq.chunk_gated_delta_rule_bwd(
                        q, k, v, g_cum, beta, A, do, dht=dht, scale=sc, initial_state=h0,
                        cu_seqlens=cu_seqlens, auto_cp=True, cp_cache=cp_cache, cp_context=ctx)
                return dq, dk, dv, dg, db, dh0

            return Op(fn, lambda out: tuple(out), "flash_qla.chunk_gated_delta_rule_bwd (low-level, fwd CP cache)")
        except Exception as e:  # private helpers moved: fall back to autograd
            print(f"[peers] flashqla low-level backward unavailable ({e!r}); using autograd", flush=True)

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta, h0)]
    o, ht = fq.chunk_gated_delta_rule(*leaves[:5], scale=scale, initial_state=leaves[5],
                                      output_final_state=True, cu_seqlens=cu_seqlens)

    def fn():
        return tuple(torch.autograd.grad((o, ht), leaves, (do, dht), retain_graph=True))

    return Op(fn, lambda out: tuple(out), "flash_qla autograd.grad (retain_graph)")


# --------------------------------------------------------------------------------------
# Training step: each backend's autograd forward, then torch.autograd.grad of (o, final
# state) given (do, dht), as a training framework runs it (what the forward saves for the
# backward included)
# --------------------------------------------------------------------------------------

def _step_op(forward, q, k, v, g, beta, h0, do, dht, note: str) -> Op:
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta, h0)]

    def fn():
        o, ht = forward(*leaves)
        return torch.autograd.grad((o, ht), leaves, (do, dht))  # dq, dk, dv, dg, dbeta, dh0

    return Op(fn, lambda out: tuple(out), note)


def qla_step(q, k, v, g, beta, h0, cu_seqlens, do, dht, *, cu_seqlens_cpu=None, scale=None) -> Optional[Op]:
    qla = _import_qla()
    if qla is None:
        return None
    kwargs = _host_lengths(qla.chunk_gated_delta_rule, cu_seqlens_cpu)

    def forward(q_, k_, v_, g_, b_, h0_):
        return qla.chunk_gated_delta_rule(q_, k_, v_, g_, b_, scale=scale, initial_state=h0_,
                                          output_final_state=True, cu_seqlens=cu_seqlens, **kwargs)

    return _step_op(forward, q, k, v, g, beta, h0, do, dht, "qla.chunk_gated_delta_rule + autograd.grad")


def fla_step(q, k, v, g, beta, h0, cu_seqlens, do, dht, *, cu_seqlens_cpu=None, scale=None) -> Optional[Op]:
    mod = _import_fla()
    if mod is None:
        return None
    lift_fla_hopper_guard()
    cu64 = _long(cu_seqlens)
    ci = _fla_chunk_indices(cu64, cu_seqlens_cpu)

    def forward(q_, k_, v_, g_, b_, h0_):
        return mod.chunk_gated_delta_rule(q_, k_, v_, g_, b_, scale=scale, initial_state=h0_,
                                          output_final_state=True, cu_seqlens=cu64, chunk_indices=ci)

    return _step_op(forward, q, k, v, g, beta, h0, do, dht, "fla chunk_gated_delta_rule + autograd.grad (guard lifted)")


def flashqla_step(q, k, v, g, beta, h0, cu_seqlens, do, dht, *, cu_seqlens_cpu=None, scale=None) -> Optional[Op]:
    fq = _import_flashqla()
    if fq is None:
        return None
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return _skip("flashqla", "needs K = V = 128")

    def forward(q_, k_, v_, g_, b_, h0_):
        return fq.chunk_gated_delta_rule(q_, k_, v_, g_, b_, scale=scale, initial_state=h0_,
                                         output_final_state=True, cu_seqlens=cu_seqlens)

    return _step_op(forward, q, k, v, g, beta, h0, do, dht, "flash_qla.chunk_gated_delta_rule + autograd.grad")


# --------------------------------------------------------------------------------------
# FlashInfer (forward only)
# --------------------------------------------------------------------------------------

def install_flashinfer_aot(so_path: str) -> bool:
    """Place a prebuilt gdn_prefill_sm90.so (built by an earlier run, see
    export_flashinfer_jit) where FlashInfer looks for AOT modules, so no nvcc build is
    needed. Returns True when installed."""
    if not so_path or not os.path.isfile(so_path):
        return False
    try:
        from flashinfer.jit import env as fi_env
    except Exception:
        return False
    dst = os.path.join(str(fi_env.FLASHINFER_AOT_DIR), "gdn_prefill_sm90")
    os.makedirs(dst, exist_ok=True)
    shutil.copyfile(so_path, os.path.join(dst, "gdn_prefill_sm90.so"))
    return True


def flashinfer_jit_so() -> Optional[str]:
    """Path of the JIT-built gdn_prefill_sm90.so, once built (None before)."""
    try:
        from flashinfer.jit.gdn import gen_gdn_prefill_sm90_module
        spec = gen_gdn_prefill_sm90_module()
        p = spec.get_library_path()
        return str(p) if os.path.isfile(p) else None
    except Exception:
        return None


def flashinfer_forward(q, k, v, g, beta, h0, cu_seqlens, *, cu_seqlens_cpu=None, scale=None) -> Optional[Op]:
    """flashinfer.gdn_prefill.chunk_gated_delta_rule takes packed [T, H, D] tensors, a
    LINEAR gate alpha = exp(g) (fp32, [T, HV]) and states in [N, HV, V, K] layout; its
    output is [T, max(H, HV), D]. All three conversions happen here, once."""
    fi = _import_flashinfer()
    if fi is None:
        return None
    major = torch.cuda.get_device_capability(q.device)[0]
    if major not in (9, 10):
        return _skip("flashinfer", f"GDN prefill needs SM90 or SM100, got SM{major}x")
    qp, kp, vp = q[0].contiguous(), k[0].contiguous(), v[0].contiguous()
    alpha = torch.exp(g[0].float()).contiguous()
    bp = beta[0].float().contiguous()
    h0_vk = h0.transpose(-1, -2).contiguous()
    cu64 = _long(cu_seqlens)
    # 0.7 and later (the CuTe-DSL prefill with its own splitting, use_cp="auto" by default) want
    # the final state's buffer from the caller; 0.6.13 allocates it.
    extra = {}
    if "output_state" in inspect.signature(fi.chunk_gated_delta_rule).parameters:
        extra["output_state"] = torch.empty_like(h0_vk)

    def fn():
        with torch.no_grad():
            return fi.chunk_gated_delta_rule(qp, kp, vp, alpha, bp, scale=scale, initial_state=h0_vk,
                                             output_final_state=True, cu_seqlens=cu64, **extra)

    def to_common(out):
        o, ht = out
        return o.unsqueeze(0), ht.transpose(-1, -2)

    return Op(fn, to_common, "flashinfer.gdn_prefill.chunk_gated_delta_rule (alpha=exp(g), [V,K] state), no_grad")


# --------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------

FWD_FACTORIES: Dict[str, Callable[..., Optional[Op]]] = {
    "qla": qla_forward,
    "fla": fla_forward,
    "flashqla": flashqla_forward,
    "flashinfer": flashinfer_forward,
}
BWD_FACTORIES: Dict[str, Callable[..., Optional[Op]]] = {
    "qla": qla_backward,
    "fla": fla_backward,
    "flashqla": flashqla_backward,
}
STEP_FACTORIES: Dict[str, Callable[..., Optional[Op]]] = {
    "qla": qla_step,
    "fla": fla_step,
    "flashqla": flashqla_step,
}


def make_op(backend: str, kind: str, inp, **kw) -> Optional[Op]:
    """Build backend `backend`'s op of kind "fwd" / "bwd" / "step" on a grid.Inputs."""
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0, inp.cu_seqlens)
    if kind == "fwd":
        factory = FWD_FACTORIES.get(backend)
        if factory is None:
            return None
        return factory(*args, cu_seqlens_cpu=inp.cu_seqlens_cpu, **kw)
    factory = (STEP_FACTORIES if kind == "step" else BWD_FACTORIES).get(backend)
    if factory is None:
        return None
    return factory(*args, inp.do, inp.dht, cu_seqlens_cpu=inp.cu_seqlens_cpu, **kw)


def rel_l2(x: Optional[torch.Tensor], ref: Optional[torch.Tensor]) -> float:
    if x is None or ref is None or x.shape != ref.shape:
        return float("nan")
    x, ref = x.double(), ref.double()
    den = ref.norm().item()
    return (x - ref).norm().item() / den if den > 0 else (x - ref).norm().item()


def unavailable() -> List[str]:
    return list(_reasons.keys())
