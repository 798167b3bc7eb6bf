"""Runs the benchmark grid of shared/docs/benchmarks.md: QLA beside FLA (Triton), FlashQLA
and FlashInfer, same process, same GPU, same input tensors.

    python3 bench/run_grid.py --out bench/results/h200.md              # everything
    python3 bench/run_grid.py --kind fwd --shard 1/3 --json $OUT/f1.json
    python3 bench/run_grid.py --merge $OUT/f1.json f2.json ... --out bench/results/h200.md
    python3 bench/run_grid.py --list                                   # rows only, no GPU

Per row it prints the ms of every backend, each peer's time / QLA's time, and QLA's time /
floor (gdn.md section 4, with the ceilings measured at the start of the same run). --out
writes a markdown table with the run's header and the geometric-mean ratios; --json keeps
the raw numbers (shards can be merged). Importable and runnable without CUDA (--list,
--merge); without a GPU it says so and exits 0.

Peers travel to the device as .whl/ (scripts/fetch_peer_wheels.sh); see bench/PEERS.md.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import lzma
import math
import os
import shlex
import subprocess
import sys
import time
from typing import Dict, List, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import torch  # noqa: E402

import grid  # noqa: E402

PEER_ORDER = ["fla", "flashqla", "flashinfer"]


# --------------------------------------------------------------------------------------
# Row selection
# --------------------------------------------------------------------------------------

def select_rows(args) -> List[grid.Row]:
    rows: List[grid.Row] = []
    if args.kind in ("fwd", "both"):
        rows += grid.fwd_rows()
    if args.kind in ("bwd", "both"):
        rows += grid.bwd_rows()
    if args.kind == "step":
        rows += grid.bwd_rows("step")
    if args.heads:
        keys = [h.strip() for h in args.heads.split(",") if h.strip()]
        rows = [r for r in rows if any(k == r.label or k == f"{r.h}/{r.hv}" or k in r.label for k in keys)]
    if args.layouts:
        keys = [x.strip() for x in args.layouts.split(",") if x.strip()]
        rows = [r for r in rows if r.layout in keys]
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        if not (1 <= i <= n):
            raise SystemExit(f"--shard: expected i/n with 1 <= i <= n, got {args.shard}")
        rows = rows[i - 1::n]
    if args.limit:
        rows = rows[: args.limit]
    return rows


# --------------------------------------------------------------------------------------
# Environment facts for the header
# --------------------------------------------------------------------------------------

def gpu_facts() -> Dict[str, str]:
    facts = {"gpu": "-", "driver": "-", "cuda": str(torch.version.cuda)}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
        p = torch.cuda.get_device_properties(0)
        facts["sms"] = str(p.multi_processor_count)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            facts["driver"] = out.stdout.strip().splitlines()[0]
    except Exception:
        pass
    return facts


# --------------------------------------------------------------------------------------
# Running one row
# --------------------------------------------------------------------------------------

def run_row(row: grid.Row, backends: List[str], args, peers) -> Dict:
    with_grads = row.kind in ("bwd", "step")
    set_bytes = grid.estimate_set_bytes(row.lengths, row.h, row.hv, with_grads)
    n_sets = 1 if args.no_rotate else grid.n_rotating_sets(set_bytes)
    sets = []
    cu_shared = None
    cu_dtype = torch.int64 if args.cu_dtype == "int64" else torch.int32
    for s in range(n_sets):
        inp = grid.make_inputs(row.lengths, row.h, row.hv, seed=args.seed + s, gate=args.gate,
                               cu_dtype=cu_dtype, with_grads=with_grads, cu_seqlens=cu_shared)
        cu_shared = inp.cu_seqlens
        sets.append(inp)
    torch.cuda.synchronize()

    # ms: device time per call from CUDA-graph replay (the ratios use it); eager_ms: per-launch
    # events around eager calls, host overhead included; where a backend cannot be captured,
    # graph_err says why and it has eager_ms only.
    res = {"row": row.name, "kind": row.kind, "label": row.label, "h": row.h, "hv": row.hv,
           "lengths": list(row.lengths), "layout": row.layout, "T": row.T, "N": row.N,
           "sets": n_sets, "ms": {}, "eager_ms": {}, "iters": {}, "err": {}, "graph_err": {},
           "check": {}, "notes": {}}
    outs = {}
    for b in backends:
        kw = {}
        if row.kind == "bwd" and b in ("fla", "flashqla"):
            kw["mode"] = args.bwd_mode
        try:
            ops = [peers.make_op(b, row.kind, inp, **kw) for inp in sets]
        except Exception as e:  # a factory that throws (bad shapes, failed import inside)
            res["err"][b] = f"setup: {e!r}"[:300]
            continue
        if any(op is None for op in ops):
            res["err"][b] = "unavailable"
            continue
        res["notes"][b] = ops[0].note
        try:
            t0 = time.time()
            out0 = ops[0]()  # first call: JIT compilation / autotuning
            torch.cuda.synchronize()
            first_s = time.time() - t0
            if args.check:  # clone: some peers return reused static buffers
                outs[b] = tuple(t.detach().clone() if isinstance(t, torch.Tensor) else t
                                for t in ops[0].to_common(out0))
            del out0
            t = grid.time_cuda(ops, warmup=args.warmup, iters=args.iters, target_ms=args.target_ms)
            res["eager_ms"][b] = t.median_ms
            res["iters"][b] = t.iters
            if first_s > 5:
                print(f"  [{b}] first call took {first_s:.1f} s (compilation)", flush=True)
        except Exception as e:
            res["err"][b] = f"run: {e!r}"[:300]
            torch.cuda.synchronize()
            del ops
            continue
        if not args.no_graph:
            try:
                res["ms"][b] = grid.time_graph(ops, per_call_ms=res["eager_ms"][b], target_ms=args.target_ms).median_ms
            except grid.GraphCaptureError as e:
                res["graph_err"][b] = str(e)
                print(f"  [{b}] not capturable in a CUDA graph: {e}", flush=True)
        else:
            res["ms"][b] = res["eager_ms"][b]
        del ops
    if args.check and outs:
        ref_name = "qla" if "qla" in outs else next(iter(outs))
        ref = outs[ref_name]
        for b, out in outs.items():
            if b == ref_name:
                continue
            errs = [peers.rel_l2(x, r) for x, r in zip(out, ref)]
            errs = [e for e in errs if not math.isnan(e)]
            res["check"][b] = max(errs) if errs else float("nan")
        res["check_ref"] = ref_name
    del sets, outs
    torch.cuda.empty_cache()
    return res


def fmt_ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def fmt_ratio(x: Optional[float]) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.2f}"


def derive(res: Dict, ceilings: Dict[str, float]) -> Dict:
    res["floor_ms"] = grid.floor_ms(res["kind"], res["T"], res["N"], res["h"], res["hv"],
                                    ceilings["tflops"], ceilings["tbs"])
    q = res["ms"].get("qla")
    res["ratio"] = {p: res["ms"][p] / q for p in PEER_ORDER if q and p in res["ms"]}
    res["qla_x_floor"] = q / res["floor_ms"] if q else None
    return res


def print_row(res: Dict, backends: List[str]) -> None:
    parts = [f"{res['row']:<44}", f"floor {res['floor_ms']:.3f}"]
    eager = res.get("eager_ms", {})
    for b in backends:
        if b in res["ms"]:
            parts.append(f"{b} {res['ms'][b]:.3f}" + (f" (eager {eager[b]:.3f})" if b in eager else ""))
        elif b in eager:
            parts.append(f"{b} eager {eager[b]:.3f} (no graph)")
        elif b in res["err"]:
            parts.append(f"{b} ({res['err'][b][:40]})")
    for p, r in res["ratio"].items():
        parts.append(f"{p}/qla {r:.2f}")
    if res["qla_x_floor"]:
        parts.append(f"qla x floor {res['qla_x_floor']:.2f}")
    if res.get("check"):
        parts.append("chk " + " ".join(f"{b}:{e:.1e}" for b, e in res["check"].items()))
    print(" | ".join(parts), flush=True)


# --------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------

def markdown(meta: Dict, results: List[Dict]) -> str:
    lines = []
    lines.append(f"# QLA vs peers, {meta.get('gpu', '-')}")
    lines.append("")
    lines.append(f"- date: {meta.get('date', '-')}")
    lines.append(f"- GPU: {meta.get('gpu', '-')} ({meta.get('sms', '?')} SMs), driver {meta.get('driver', '-')}, "
                 f"CUDA (torch) {meta.get('cuda', '-')}")
    vers = meta.get("versions", {})
    lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()))
    c = meta.get("ceilings", {})
    if c:
        lines.append(f"- ceilings (measured in this run): bf16 8192^3 matmul {c['tflops']:.0f} TFLOP/s, "
                     f"device copy {c['tbs']:.2f} TB/s")
    for cmd in meta.get("commands", []):
        lines.append(f"- command: `{cmd}`")
    lines.append(f"- timing: {meta.get('timing', '-')}")
    lines.append(f"- inputs: {meta.get('inputs', '-')}")
    for n in meta.get("notes", []):
        lines.append(f"- {n}")
    lines.append("")

    for kind, title in (("fwd", "Forward"), ("bwd", "Backward"), ("step", "Training step (forward + backward)")):
        rows = [r for r in results if r["kind"] == kind]
        if not rows:
            continue
        bks = ["qla"] + [p for p in PEER_ORDER
                         if any(p in r["ms"] or p in r["err"] or p in r.get("eager_ms", {}) for r in rows)]
        peers_here = [p for p in bks if p != "qla"]
        has_chk = any(r.get("check") for r in rows)
        lines.append(f"## {title} (ms; ratio = peer time / QLA time, > 1 means QLA is faster)")
        lines.append("")
        hdr = ["heads (h/hv)", "layout", "floor"] + bks + [f"{p}/qla" for p in peers_here] + ["qla x floor"]
        if has_chk:
            hdr.append("max rel-L2 vs " + rows[0].get("check_ref", "qla"))
        lines.append("| " + " | ".join(hdr) + " |")
        lines.append("|" + "---|" * len(hdr))
        for r in rows:
            cells = [f"{r['label']} ({r['h']}/{r['hv']})" if r["kind"] == "fwd" else r["label"],
                     r["layout"], fmt_ms(r.get("floor_ms"))]
            for b in bks:
                if b in r["ms"]:
                    cells.append(fmt_ms(r["ms"][b]))
                elif b in r.get("graph_err", {}):
                    cells.append("no graph")
                elif b in r["err"]:
                    cells.append("n/a" if r["err"][b] == "unavailable" else "error")
                else:
                    cells.append("-")
            for p in peers_here:
                cells.append(fmt_ratio(r["ratio"].get(p)))
            cells.append(fmt_ratio(r.get("qla_x_floor")))
            if has_chk:
                cells.append(", ".join(f"{b} {e:.1e}" for b, e in r.get("check", {}).items()) or "-")
            lines.append("| " + " | ".join(cells) + " |")
        if any(r.get("eager_ms") for r in rows):
            lines.append("")
            lines.append(f"{title}, eager per call (ms; CUDA events around each eager call, host overhead included):")
            lines.append("")
            lines.append("| " + " | ".join(["heads (h/hv)", "layout"] + bks) + " |")
            lines.append("|" + "---|" * (2 + len(bks)))
            for r in rows:
                eager = r.get("eager_ms", {})
                cells = [f"{r['label']} ({r['h']}/{r['hv']})" if r["kind"] == "fwd" else r["label"], r["layout"]]
                cells += [fmt_ms(eager.get(b)) if b in eager else "-" for b in bks]
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines.append(f"Geometric means over {title.lower()} rows where both ran:")
        lines.append("")
        for p in peers_here:
            rs = [r["ratio"][p] for r in rows if p in r["ratio"]]
            if rs:
                lines.append(f"- {p} / qla: {grid.geomean(rs):.3f} ({len(rs)} rows)")
        xs = [r["qla_x_floor"] for r in rows if r.get("qla_x_floor")]
        if xs:
            lines.append(f"- qla x floor: {grid.geomean(xs):.3f} ({len(xs)} rows)")
        errs = sorted({f"{b}: {e}" for r in rows for b, e in r["err"].items() if e != "unavailable"})
        errs += sorted({f"{b} (not capturable in a CUDA graph; eager time only): {e}"
                        for r in rows for b, e in r.get("graph_err", {}).items()})
        if errs:
            lines.append("")
            lines.append("Errors:")
            for e in errs[:20]:
                lines.append(f"- {e}")
        lines.append("")
    return "\n".join(lines) + "\n"


def write_outputs(args, meta: Dict, results: List[Dict]) -> None:
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(markdown(meta, results))


def merge_rows(results: List[Dict]) -> List[Dict]:
    """Rows of the same name from several files (each backend timed by its own process, one after
    another on the same GPU: peers that crash when loaded beside each other) become one row:
    the backends' times side by side, the ratios taken again, the first file's floor."""
    by: Dict[str, Dict] = {}
    for r in results:
        m = by.setdefault(r["row"], r)
        if m is r:
            continue
        for field in ("ms", "eager_ms", "iters", "err", "graph_err", "notes", "check"):
            m.setdefault(field, {}).update(r.get(field, {}))
    for m in by.values():
        q = m["ms"].get("qla")
        m["ratio"] = {p: m["ms"][p] / q for p in PEER_ORDER if q and p in m["ms"]}
        m["qla_x_floor"] = q / m["floor_ms"] if q and m.get("floor_ms") else None
    return list(by.values())


def merge(args) -> int:
    metas, results = [], []
    for path in args.merge:
        with open(path) as f:
            d = json.load(f)
        metas.append(d["meta"])
        results += d["results"]
    n_in = len(results)
    results = merge_rows(results)
    meta = dict(metas[0])
    if len(results) < n_in:
        meta.setdefault("notes", []).append(
            "backends timed in separate processes, one after another on the same GPU, then merged by row")
    meta["commands"] = [c for m in metas for c in m.get("commands", [])]
    if len({json.dumps(m.get("ceilings")) for m in metas}) > 1:
        meta.setdefault("notes", []).append(
            "shards were measured in different runs; each row's floor uses its own run's ceilings")
    meta["commands"].append(shlex.join(["python3"] + sys.argv))
    write_outputs(args, meta, results)
    print(f"merged {len(results)} rows from {len(args.merge)} files")
    return 0


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="markdown table to write")
    ap.add_argument("--json", help="raw results (JSON) to write; shards can be --merge'd")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge shard JSONs into --out / --json (no GPU)")
    ap.add_argument("--list", action="store_true", help="print the selected rows and exit (no GPU)")
    ap.add_argument("--kind", choices=["fwd", "bwd", "both", "step"], default="both",
                    help="step: the backward grid's rows as training steps (autograd forward + backward)")
    ap.add_argument("--backends", default="qla,fla,flashqla,flashinfer",
                    help="comma list among qla, fla, flashqla, flashinfer (flashinfer is forward only)")
    ap.add_argument("--heads", help="comma list of head configs: label ('27B TP1'), substring, or 'h/hv'")
    ap.add_argument("--layouts", help="comma list of layouts as printed (1x32768, 28672+4096, 8192x4)")
    ap.add_argument("--shard", help="i/n: every n-th row starting at the i-th (1-based)")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--gate", choices=["standard", "strong", "none"], default="standard")
    ap.add_argument("--cu-dtype", choices=["int32", "int64"], default="int32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=None, help="timed launches (default: ~--target-ms of GPU time)")
    ap.add_argument("--target-ms", type=float, default=300.0)
    ap.add_argument("--no-rotate", action="store_true", help="one input set per row (inputs may sit in L2)")
    ap.add_argument("--no-graph", action="store_true",
                    help="eager timing only (the ratios then come from eager times, host overhead included)")
    ap.add_argument("--bwd-mode", choices=["lowlevel", "autograd"], default="lowlevel")
    ap.add_argument("--check", action="store_true",
                    help="also compare every backend's outputs (set 0) with QLA's: max rel-L2")
    ap.add_argument("--ceilings", help="'TFLOPS,TBS' to skip measuring them (e.g. 788,4.28)")
    ap.add_argument("--cache-dir", default=os.environ.get("QLA_BENCH_CACHE", "/tmp/qla_bench_cache"),
                    help="Triton / TileLang / FlashInfer JIT caches (kept on a warm machine)")
    ap.add_argument("--fi-aot", help="prebuilt FlashInfer gdn_prefill_sm90.so (or .so.xz) to install, skipping nvcc")
    ap.add_argument("--fi-export", metavar="DIR",
                    help="after the run, write the JIT-built gdn_prefill_sm90.so.xz to DIR (e.g. $OUT)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    rows = select_rows(args)
    if args.list:
        for r in rows:
            print(f"{r.name}  T={r.T} N={r.N}")
        print(f"{len(rows)} rows")
        return 0
    if not torch.cuda.is_available():
        print("run_grid: CUDA is not available here; nothing to time (use --list to see the rows).")
        return 0

    import peers  # after the cache dirs are set, so the peers see them
    peers.set_cache_dirs(args.cache_dir)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in peers.FWD_BACKENDS]
    if unknown:
        raise SystemExit(f"--backends: unknown {unknown}; expected among {peers.FWD_BACKENDS}")
    if args.fi_aot and "flashinfer" in backends:
        so = args.fi_aot
        if so.endswith(".xz"):
            dst = os.path.join(args.cache_dir, "gdn_prefill_sm90.so")
            with lzma.open(so) as f, open(dst, "wb") as g:
                g.write(f.read())
            so = dst
        print(f"[flashinfer] prebuilt module installed: {peers.install_flashinfer_aot(so)}", flush=True)

    facts = gpu_facts()
    if args.ceilings:
        tf, tb = (float(x) for x in args.ceilings.split(","))
        ceilings = {"tflops": tf, "tbs": tb, "measured": False}
    else:
        ceilings = grid.measure_ceilings()
        ceilings["measured"] = True
    print(f"{facts['gpu']}, driver {facts['driver']}: bf16 matmul {ceilings['tflops']:.0f} TFLOP/s, "
          f"copy {ceilings['tbs']:.2f} TB/s", flush=True)

    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        **facts,
        "versions": peers.versions(),
        "ceilings": ceilings,
        "commands": [shlex.join(["python3"] + sys.argv)],
        "timing": ((f"device time from CUDA-graph replay (grid.time_graph: one graph of back-to-back calls, "
                    f"about 20 ms of GPU time, cycling the input sets; per replay / calls; median over replays), "
                    f"the ratios from it; eager: " if not args.no_graph else "eager only: ") +
                   f"CUDA events around each launch, median of the timed launches after the first call "
                   f"(JIT/autotune) and {args.warmup} warm-up rounds; input sets rotated when one set is "
                   f"< 60 MB (x2 L2 in total); forward under no_grad with initial state "
                   f"and final state; backward: {args.bwd_mode} (FLA guard of issue 640 lifted); training step: "
                   f"forward with autograd and torch.autograd.grad of (o, final state) given (do, dht)"),
        "inputs": (f"q, k l2-normalised randn bf16; v randn bf16; g = logsigmoid(randn)/16 fp32 with g = 0 "
                   f"on 25% of value heads (gate={args.gate}); beta = sigmoid(randn) fp32; h0 randn fp32; "
                   f"do randn; dht randn/8; cu_seqlens {args.cu_dtype}"),
        "notes": ["FLA: Triton path forced (FLA_FLASH_QLA=0, FLA_TILELANG=0)",
                  "FlashInfer: given alpha = exp(g) and the [N, HV, V, K] state (converted outside the timing)"],
    }

    results = []
    for i, row in enumerate(rows):
        bks = [b for b in backends if row.kind == "fwd" or b in peers.BWD_BACKENDS]
        try:
            res = run_row(row, bks, args, peers)
        except torch.cuda.OutOfMemoryError as e:
            print(f"{row.name}: out of memory ({e})", flush=True)
            torch.cuda.empty_cache()
            continue
        derive(res, ceilings)
        print_row(res, bks)
        results.append(res)
        write_outputs(args, meta, results)  # keep partial results if a later row dies or time runs out
    for why in peers.unavailable():
        print(f"[peers] {why}")
    write_outputs(args, meta, results)

    for kind in ("fwd", "bwd", "step"):
        rs = [r for r in results if r["kind"] == kind]
        for p in PEER_ORDER:
            xs = [r["ratio"][p] for r in rs if p in r["ratio"]]
            if xs:
                print(f"geomean {kind} {p}/qla: {grid.geomean(xs):.3f} over {len(xs)} rows")
        xs = [r["qla_x_floor"] for r in rs if r.get("qla_x_floor")]
        if xs:
            print(f"geomean {kind} qla x floor: {grid.geomean(xs):.3f} over {len(xs)} rows")

    if args.fi_export:
        so = peers.flashinfer_jit_so()
        if so:
            os.makedirs(args.fi_export, exist_ok=True)
            dst = os.path.join(args.fi_export, "gdn_prefill_sm90.so.xz")
            with open(so, "rb") as f, lzma.open(dst, "wb", preset=6) as g:
                g.write(f.read())
            print(f"[flashinfer] exported {so} -> {dst} ({os.path.getsize(dst) / 2**20:.1f} MiB)")
        else:
            print("[flashinfer] nothing to export (module not built)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
