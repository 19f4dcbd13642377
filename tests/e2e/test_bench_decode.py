"""A real vLLM engine's decode step time against batch size (``python -m
rlpacer_trainer.bench_decode``), against the simulator's CPU cost model's form: one step costs
``base + per_seq x batch`` (module rlpacer.sim.cost). The constants are printed against the
model's (docs/benchmarks.md records them); the form is asserted."""

from __future__ import annotations

import pytest

from rlpacer_trainer import bench_decode

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(600)]


def test_a_decode_step_costs_a_base_plus_a_cost_per_running_sequence() -> None:
    # the fastest step per batch: this tier runs beside another on the same two cores
    points = bench_decode.measure([1, 8, 64, 128], steps=16, stat="min")
    base, per_seq = bench_decode.fit(points)
    for r in bench_decode.report(points):
        print(f"batch {r['batch']}: {r['measured_s'] * 1e3:.2f} ms/step, the simulator's CPU"
              f" model {r['model_s'] * 1e3:.2f} ms ({r['ratio']:.2f}x)")
    print(f"fit: {base * 1e3:.2f} ms + {per_seq * 1e3:.4f} ms x batch")
    # a base every step pays, and a cost per running sequence: a batch of 128 costs more than
    # one sequence's step, far less than 128 of them (why a straggler alone wastes an engine)
    assert base > 0 and per_seq > 0
    assert 1.5 * points[1] < points[128] < 0.5 * 128 * points[1], points
    # the linear form holds: every point within 30% of this run's own fit
    for b, t in points.items():
        assert abs(t - (base + per_seq * b)) <= 0.3 * t, (b, t, base, per_seq)
