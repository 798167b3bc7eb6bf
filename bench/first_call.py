"""Cold start: how long a backend's first forward call takes against its second, each
(backend, row) in a fresh Python process with empty JIT caches.

    python3 bench/first_call.py [--backends qla,flashqla,flashinfer] [--peer-rows 1]
                                [--qla-variants V,...] [--timeout 600] [--json F] [--out F]

The rows are qla.bench's Qwen3.5 shapes (bf16, initial state in, final state out, packed
with cu_seqlens). In each child process:
  1. torch is imported and the inputs are made on the GPU, so the CUDA context exists and
     torch's own start-up is not counted;
  2. the backend is imported (`import_s`): after step 1 for the peers; for QLA before or
     after it, by variant (QLA_VARIANTS: where QLA's one-time kernel loading falls);
  3. the first call, then the second, each timed on the host clock up to a device
     synchronize (`first_s`, `second_s`): wall time, host and device work together;
  4. ten more calls, their median (`warm_s`).
The outputs of a call are dropped before the next one, so no call finds the memory of
another still in use. The peers get fresh, empty cache folders (Triton, TileLang,
FlashInfer's JIT workspace), so their first call compiles what it needs, as on a new
machine. QLA runs all rows; the peers the first --peer-rows (their JIT costs minutes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def layout(lengths):
    return f"1x{lengths[0]}" if len(lengths) == 1 else f"{lengths[0]}x{len(lengths)}"


QLA_VARIANTS = {
    # where the one-time work of loading the kernels falls (see python/qla/__init__.py)
    "import-before-cuda": "qla imported before CUDA is up: its runtime starts with torch's, the first call loads the kernels",
    "import-after-cuda": "qla imported once a context exists: the import does both",
    "prepare": "imported before, then qla.prepare_cuda_device() at start-up (timed apart, prepare_s)",
}


def child(backend: str, spec: str, variant: str) -> dict:
    t_start = time.perf_counter()
    import torch

    import grid
    import peers

    importer = {"qla": peers._import_qla, "flashqla": peers._import_flashqla,
                "flashinfer": peers._import_flashinfer}[backend]
    import_s = 0.0
    before = backend == "qla" and variant != "import-after-cuda"
    if before:
        t0 = time.perf_counter()
        if importer() is None:
            return {"backend": backend, "error": "import failed"}
        import_s = time.perf_counter() - t0
    label, H, HV, lengths = json.loads(spec)
    inp = grid.make_inputs(lengths, H, HV, device="cuda", seed=0)
    torch.cuda.synchronize()
    t_inputs = time.perf_counter()
    if not before:
        t0 = time.perf_counter()
        if importer() is None:
            return {"backend": backend, "error": "import failed"}
        torch.cuda.synchronize()
        import_s = time.perf_counter() - t0
    prepare_s = 0.0
    if backend == "qla" and variant == "prepare":
        import qla
        t0 = time.perf_counter()
        qla.prepare_cuda_device()
        prepare_s = time.perf_counter() - t0
    op = peers.make_op(backend, "fwd", inp)
    if op is None:
        return {"backend": backend, "error": "backend cannot run this row"}

    def timed():
        t = time.perf_counter()
        out = op()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        del out
        return dt

    first = timed()
    second = timed()
    warm = statistics.median(timed() for _ in range(10))
    return {"backend": backend, "variant": variant, "row": label, "heads": f"{H}/{HV}", "layout": layout(lengths),
            "process_to_inputs_s": t_inputs - t_start, "import_s": import_s, "prepare_s": prepare_s, "first_s": first,
            "second_s": second, "warm_s": warm, "first_over_second": first / second,
            "versions": {k: v for k, v in peers.versions().items() if k in ("torch", backend.replace("flashqla", "flash-qla"))}}


def run_child(backend: str, row, timeout: float, variant: str) -> dict:
    env = dict(os.environ)
    caches = tempfile.mkdtemp(prefix=f"first_call_{backend}_")
    # Empty JIT caches for every peer (they are set before any peer is imported).
    env.update(TRITON_CACHE_DIR=os.path.join(caches, "triton"), TILELANG_CACHE_DIR=os.path.join(caches, "tilelang"),
               FLASHINFER_WORKSPACE_BASE=os.path.join(caches, "flashinfer"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", backend, json.dumps(row), variant]
    label, H, HV, lengths = row
    base = {"backend": backend, "variant": variant, "row": label, "heads": f"{H}/{HV}", "layout": layout(lengths)}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**base, "error": f"first call not done within {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or [""]
        errors = [ln for ln in lines if "Error" in ln]  # the exception line, not the hints after it
        return {**base, "error": f"exit {proc.returncode}: {(errors or lines)[-1].strip()[:300]}"}
    out = json.loads(lines[-1])
    out["process_s"] = time.perf_counter() - start
    return out


def table(results) -> str:
    lines = ["| backend | variant | heads | layout | import s | prepare ms | first call ms | second call ms | warm ms | first / second |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['variant']} | {r.get('heads', '')} | {r.get('layout', '')} | {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['backend']} | {r['variant']} | {r['heads']} | {r['layout']} | {r['import_s']:.3f} | {r['prepare_s'] * 1e3:.1f} | {r['first_s'] * 1e3:.1f} | "
                     f"{r['second_s'] * 1e3:.2f} | {r['warm_s'] * 1e3:.2f} | {r['first_over_second']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="qla,flashqla,flashinfer")
    ap.add_argument("--peer-rows", type=int, default=1, help="rows for the peers (the first N of qla.bench's)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a child may take")
    ap.add_argument("--json")
    ap.add_argument("--out")
    ap.add_argument("--qla-variants", default=",".join(QLA_VARIANTS),
                    help="comma-separated, of: " + "; ".join(f"{k}: {v}" for k, v in QLA_VARIANTS.items()))
    ap.add_argument("--child", nargs=3, metavar=("BACKEND", "ROW", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)), flush=True)
        return 0
    from qla.bench import QWEN_ROWS  # the parent only: a peer's child process never loads qla

    results = []
    for backend in args.backends.split(","):
        rows = QWEN_ROWS if backend == "qla" else QWEN_ROWS[: args.peer_rows]
        variants = args.qla_variants.split(",") if backend == "qla" else ["import-after-cuda"]
        for variant in variants:
            for row in rows:
                r = run_child(backend, row, args.timeout, variant)
                results.append(r)
                print(json.dumps(r), flush=True)
    md = table(results)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "results": results}, f, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
