"""The fused reverse step's shared-memory slot table (bench/fused_reverse_layout.py): the planned
schedule fits the SM's shared memory, and the checker refuses the schedules it must refuse."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import fused_reverse_layout as frl  # noqa: E402


def _slots(schedule):
    life, n, first_w, last_r, readers, writer = frl.lifetimes(schedule)
    slots, where = frl.assign(life, n, first_w, last_r, readers, writer)
    return slots, where


def test_planned_schedule_fits_with_every_tile_in_a_slot_of_its_size():
    slots, where = _slots(frl.SCHEDULE)
    assert sum(s[0] for s in slots) + 2 <= 227
    for t, i in where.items():
        assert slots[i][0] == frl.TILES[t]
    # No two tiles of a slot live at the same half-step.
    life, *_ = frl.lifetimes(frl.SCHEDULE)
    for _, _, tiles in slots:
        for a in range(len(tiles)):
            for b in range(a + 1, len(tiles)):
                assert not (life[tiles[a]][1] & life[tiles[b]][1]), (tiles[a], tiles[b])


def test_a_read_before_the_write_is_refused():
    bad = [[("A", "dP", ["dO", "U"], ["dA"])], [("A", "U", ["Tm", "Z"], ["U"])]]
    with pytest.raises(SystemExit, match="reads U before it is written"):
        frl.lifetimes(bad)


def test_another_role_s_read_in_the_same_phase_keeps_the_slot():
    # Z is last read by role A in phase 1 while dW (same size) is written in phase 1: written by
    # role K (no order against A's read) it must take another slot; written by A itself (program
    # order: the read, the wait, then the epilogue's write) it may take Z's.
    def sched(role):
        return [[("A", "Z", ["K"], ["Z"])],
                [("A", "Y = Z K^T", ["Z", "K"], []), (role, "dW", ["S"], ["dW"])],
                [("A", "read dW", ["dW"], [])]]
    _, where_k = _slots(sched("K"))
    _, where_a = _slots(sched("A"))
    assert where_k["dW"] != where_k["Z"]
    assert where_a["dW"] == where_a["Z"]
