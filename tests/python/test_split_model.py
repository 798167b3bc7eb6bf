"""The sm90 forward's splitting cost model (bench/split_cost_model.py reads its coefficients from
src/sm90/split_plan.cuh and gdn_fwd_sm90.cu) against the committed device measurements: no GPU needed."""
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))

import split_cost_model as scm  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results", "raw", "fwd_split_bench_2026-12-01.txt")


def test_model_picks_the_measured_best_piece_count():
    rows = scm.parse(RESULTS)
    assert len(rows) == 9 and {r["name"] for r in rows} >= {"2/8 1x32768", "16/16 1x32768", "4/16 4096x2"}
    co = scm.source_coefficients()
    assert scm.regret(co, rows) < 1.001  # on every mixed-gate row the pick is the fastest measured
    by_name = {r["name"]: r for r in rows}
    assert by_name["4/16 4096x2"]["pairs"] == 32 and by_name["4/16 4096x2"]["longest"] == 64
    assert scm.best_pieces(co, by_name["2/8 1x32768"]) == 8
    assert scm.best_pieces(co, by_name["4/16 4096x2"]) == 1  # 32 pairs of 64 chunks: not split


def test_piece_count_matches_the_kernels_rule():
    # piece_split (common.cuh): the longest sequence's pieces from a piece length and a cap.
    assert scm.pieces_of(512, 64, 64) == 8
    assert scm.pieces_of(5, 3, 64) == 2   # len 3: pieces of 3 and 2
    assert scm.pieces_of(47, 1, 64) == 47
    assert scm.pieces_of(64, 64, 64) == 1
    assert scm.pieces_of(4096, 1, 64) == 64


def test_short_rows_stay_unsplit_and_uneven_wide_rows_too():
    # The short rows of the sixth session's --split --bench: there no piece count beat the
    # unsplit fused forward, and the model keeps them whole.
    rows = {r["name"]: r for r in scm.parse(os.path.join(ROOT, "bench", "results", "raw",
                                                         "fwd_split_bench_short_2026-12-01.txt"))}
    co = scm.source_coefficients()
    assert scm.regret(co, list(rows.values())) < 1.01
    for name in ("2/8 1x2048", "16/32 1x2048", "8/24 1x4096"):
        assert min(rows[name]["times"], key=rows[name]["times"].get) == 1, name
        assert scm.best_pieces(co, rows[name]) == 1, name
    # Many length-weighted pairs (16/64 at 28672 + 4096 tokens: 64 x 512 / 448 chunks) and 96 equal
    # pairs of 256 chunks: unsplit, as the grid measured best (split-3 in docs/design.md: 1.48
    # against 1.80 ms split in two); a few-pair long sequence still splits.
    assert scm.best_pieces(co, dict(pairs=64 * 512 / 448, longest=448)) == 1
    assert scm.best_pieces(co, dict(pairs=96, longest=256)) == 1
    assert scm.best_pieces(co, dict(pairs=8, longest=512)) == 8


def test_few_pair_rows_split_after_the_narrow_scan():
    # The sixteenth session's --split --bench (the scan at 8 state columns per CTA): the model
    # picks the measured best piece count or one within 3% of it (the kernels before split-8).
    rows = scm.parse(os.path.join(ROOT, "bench", "results", "raw", "fwd_split_bench_2026-12-03.txt"))
    co = scm.source_coefficients()
    assert len(rows) >= 13
    assert scm.regret(co, rows) < 1.01


def test_model_still_picks_after_the_warm_loads_and_blocked_scan():
    # The seventeenth session's kept binary (split-5): the model's pick is the measured best or
    # within 2% (2/8 at 1x32768: 8 pieces 0.347-0.349 ms, 16 pieces 0.342-0.345).
    rows = scm.parse(os.path.join(ROOT, "bench", "results", "raw", "fwd_split_bench_2026-12-04.txt"))
    co = scm.source_coefficients()
    assert len(rows) == 26
    assert scm.regret(co, rows) < 1.005


def test_v_tile_lines_parse_and_the_pass1_prediction(tmp_path):
    # `--split --bench` prints, since split-7, the forced piece lengths again with pass 1 at V tile
    # 128 (pass 0 at 64 or 128). parse_vt merges them by row with the 64 / 64 line.
    f = tmp_path / "vt.txt"
    f.write_text(
        "bench-split 2/8 1x32768              two-pass 0.861  fused 1.110  auto 0.349  | pieces 4: 0.641 8: 0.642"
        " 16: 0.445 32: 0.342 64: 0.347 128: 0.575 ms\n"
        "bench-split-vt 2/8 1x32768           V tiles  64 / 128 | pieces 4: 0.600 8: 0.600 16: 0.420 32: 0.300"
        " 64: 0.330 128: 0.560 ms\n"
        "bench-split-vt 2/8 1x32768           V tiles 128 / 128 | pieces 4: 0.610 8: 0.610 16: 0.430 32: 0.310"
        " 64: 0.340 128: 0.570 ms\n")
    rows = scm.parse_vt(str(f))
    assert len(rows) == 1 and set(rows[0]["times"]) == {(64, 64), (64, 128), (128, 128)}
    assert rows[0]["times"][(64, 128)][16] == 0.300  # pieces of 32 chunks: 16 pieces of 512 chunks
    co = scm.source_coefficients()
    # The default tiles are the C++ model's (64 / 64 everywhere).
    assert scm.cost_us(co, 8, 512, 16) == scm.cost_us(co, 8, 512, 16, vt=(64, 64), vt128_scale=9.0)
    # 2/8 1x32768 in 16 pieces: pass 1 at V tile 64 takes 252 CTAs (two waves), at 128 one wave;
    # with a step 1.5x as long the model predicts the gain split-7 was built for.
    assert scm.cost_us(co, 8, 512, 16, vt=(64, 128)) < 0.9 * scm.cost_us(co, 8, 512, 16)
    assert scm.vt_regret(co, rows, 1.5) >= 1.0


def test_plan_after_the_lean_pass_and_the_pass1_tile():
    # The eighteenth session's kernels (split-7, split-8): pass 0 lean at V tile 64, pass 1 at 64
    # or 128. --split --bench timed every forced piece count at both pass-1 tiles; the plan picks
    # the measured best option on every mixed-gate row the fused forward serves but one (4/16 at
    # 4096x2 stays whole under kSplitMinGain: 0.158 ms against 0.155 in 4 pieces; the scales
    # fitted by --plan).
    rows = scm.parse_vt(os.path.join(ROOT, "bench", "results", "raw", "fwd_split_bench_2026-12-04b.txt"))
    co = scm.source_coefficients()
    assert len(rows) == 13 and all(set(r["times"]) == {(64, 64), (64, 128)} for r in rows)
    assert scm.plan_regret(co, rows) < 1.005
    # 2/8 at 1x32768: 16 pieces, pass 1 at V tile 128 (0.281 ms; 0.350 before split-7 and split-8).
    assert scm.best_pieces(co, dict(pairs=8, longest=512), plan=True) == 16
    assert scm.plan_cost(co, 8, 512, 16)[1] == 128
    # The dispatch (this session's --short-bench): fused and split on 8 and 16 pairs of 64 chunks
    # (2/8 at 1x4096 0.094 ms against the two-pass 0.131; 4/16 there 0.119 against 0.130; 2/8 at
    # 4096+4096 0.122 against 0.133), the two-pass forward at 32 chunks (2/8 at 1x2048: 0.076
    # against 0.083 fused).
    assert scm.takes_fused(co, 8, 64) and scm.takes_fused(co, 16, 64)
    assert scm.takes_fused(co, 8, 128) and scm.takes_fused(co, 16, 128)
    assert not scm.takes_fused(co, 8, 32)
    assert scm.takes_fused(co, 20, 8)  # the pair threshold alone
    # Rows that fill the SMs unsplit stay whole: 128 pairs of 128 chunks (16/32 at 8192x4 ran
    # 0.70 ms split in two against 0.57 whole), 128 and 256 pairs of 64, and the close calls of
    # 48 and 64 long pairs (a predicted gain under 7%: kSplitMinGain).
    for pairs, longest in ((128, 128), (256, 128), (128, 64), (256, 64), (64, 512), (48, 512), (64, 256)):
        assert scm.best_pieces(co, dict(pairs=pairs, longest=longest), plan=True) == 1, (pairs, longest)


def test_the_whole_dispatch_on_the_calibration_run():
    # The nineteenth session's H200 run (split-9 kernels): what path_rule and forward_choice
    # run, two-pass forward included, is within 1% of the best measured option in geometric
    # mean; its worst row is 2/8 1x2048, which the dispatch gives the two-pass forward (0.079 ms)
    # where pieces of 4 chunks measured 0.074.
    path = os.path.join(ROOT, "bench", "results", "raw", "split_check_scan_2026-12-04c.txt")
    co = scm.source_coefficients()
    assert scm.dispatch_regret(co, path) < 1.01
    assert scm._two_pass_times(path)["2/8 1x2048"] == 0.079
    # A threshold that sends every few-pair row to the two-pass forward costs more.
    assert scm.dispatch_regret(dict(co, kFusedMinChunks=1e9), path) > scm.dispatch_regret(co, path) + 0.05
