"""The benchmark grid's bookkeeping (bench/grid.py, bench/run_grid.py): the training-step rows and
their floor, and the merge of rows timed by one process per backend. No GPU needed."""
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))

import grid  # noqa: E402
import run_grid  # noqa: E402


def test_step_rows_are_the_backward_rows():
    bwd, step = grid.bwd_rows(), grid.bwd_rows("step")
    assert len(step) == len(bwd) == 32
    assert [(r.h, r.hv, r.lengths) for r in step] == [(r.h, r.hv, r.lengths) for r in bwd]
    assert {r.kind for r in step} == {"step"} and step[0].name.startswith("step ")


def test_step_floor_is_the_forward_s_plus_the_backward_s():
    for r in grid.bwd_rows("step")[::7]:
        args = (r.T, r.N, r.h, r.hv, 800.0, 4.0)
        fwd, bwd, step = (grid.floor_ms(k, *args) for k in ("fwd", "bwd", "step"))
        assert step == fwd + bwd and fwd > 0 and bwd > fwd
        assert grid.work_flops("step", r.T, r.hv) == grid.work_flops("fwd", r.T, r.hv) + grid.work_flops("bwd", r.T, r.hv)


def _row(name, ms, floor=0.5, **extra):
    r = {"row": name, "kind": "bwd", "floor_ms": floor, "ms": dict(ms), "eager_ms": {b: 2 * t for b, t in ms.items()},
         "iters": {}, "err": {}, "graph_err": {}, "notes": {b: b for b in ms}, "check": {}}
    r.update(extra)
    return r


def test_merge_joins_each_backend_s_process_by_row():
    parts = [_row("bwd 2/4 1x8192", {"qla": 1.0}), _row("bwd 2/4 1x32768", {"qla": 4.0}),
             _row("bwd 2/4 1x8192", {"fla": 3.0}), _row("bwd 2/4 1x32768", {"flashqla": 2.0}),
             _row("bwd 2/4 1x8192", {}, err={"flashqla": "run: crashed"})]
    rows = run_grid.merge_rows(parts)
    assert [r["row"] for r in rows] == ["bwd 2/4 1x8192", "bwd 2/4 1x32768"]
    a, b = rows
    assert a["ms"] == {"qla": 1.0, "fla": 3.0} and a["eager_ms"] == {"qla": 2.0, "fla": 6.0}
    assert a["ratio"] == {"fla": 3.0} and a["err"] == {"flashqla": "run: crashed"}
    assert b["ratio"] == {"flashqla": 0.5} and b["qla_x_floor"] == 8.0
    # A row without QLA has no ratios.
    (c,) = run_grid.merge_rows([_row("bwd 4/8 1x8192", {"fla": 1.0})])
    assert c["ratio"] == {} and c["qla_x_floor"] is None
