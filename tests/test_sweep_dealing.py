"""How the batch runner shares a mapped chunk's lanes among devices (sweep/batch.py)."""

from __future__ import annotations

import dataclasses

from blis_jax.sweep import batch


@dataclasses.dataclass(frozen=True)
class _Sized:
    size: float

    def work(self) -> float:
        return self.size


def _loads(lanes, order, ndev, per_device):
    return [sum(lanes[i].work() for i in order[d * per_device:(d + 1) * per_device] if i is not None)
            for d in range(ndev)]


def test_each_lane_once_and_no_device_over_its_positions():
    lanes = [_Sized(w) for w in (5.0, 3.2, 3.2, 2.9, 2.6, 2.5, 2.4, 2.3, 2.2, 2.1, 1.9, 1.9, 1.0, 0.8, 0.7)]
    order = batch._deal_longest_first(lanes, list(range(len(lanes))), ndev=2, per_device=8)
    assert len(order) == 16
    assert sorted(i for i in order if i is not None) == list(range(len(lanes)))
    assert order.count(None) == 1


def test_the_longest_lane_does_not_share_a_device_with_the_next_two():
    # the golden set's shape: one lane much longer than the rest; a snake deal put it with
    # the heavier half of the others (19.0 s of lane time on one device against 15.8 s)
    sizes = (5.05, 3.25, 3.24, 2.90, 2.63, 2.50, 2.36, 2.29, 2.21, 2.08, 1.89, 1.88, 0.96, 0.82, 0.71)
    lanes = [_Sized(w) for w in sizes]
    order = batch._deal_longest_first(lanes, list(range(len(lanes))), ndev=2, per_device=8)
    loads = _loads(lanes, order, 2, 8)
    assert max(loads) - min(loads) <= 1.0
    first = order[:8]
    assert (0 in first) != (1 in first) and (0 in first) != (2 in first)


def test_a_chunk_of_eight_over_two_devices_worked_by_hand():
    # the golden set's layout (four lanes per device); works 1..8, sorted ascending as the
    # runner's chunks are: 8→A, 7→B, 6→B (7<8), 5→A (8<13), 4→A (tie, first device), 3→B, 2→B, 1→A
    lanes = [_Sized(float(w)) for w in range(1, 9)]
    order = batch._deal_longest_first(lanes, list(range(8)), ndev=2, per_device=4)
    assert order == [7, 4, 3, 0, 6, 5, 2, 1]
    assert _loads(lanes, order, 2, 4) == [18.0, 18.0]
