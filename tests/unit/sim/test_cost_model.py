"""Cost profiles: the CPU fit matches the measured decode curve (rlpacer_trainer.bench_decode);
saturation batch definition."""

from __future__ import annotations

import pytest

from rlpacer.sim.cost import CPU_MEASURED_DECODE, fit_cpu_profile, gpu_profile, profile

pytestmark = pytest.mark.unit


def test_cpu_fit_matches_the_measured_decode_curve() -> None:
    cpu = fit_cpu_profile()
    for batch, seconds in CPU_MEASURED_DECODE.items():
        # a straight line through four measured points (median step times): within 15%
        assert cpu.step_s(batch, 0) == pytest.approx(seconds, rel=0.15)


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_saturation_batch_is_where_throughput_reaches_90_percent_of_peak(name: str) -> None:
    prof = profile(name)
    ctx = 1000.0
    sat = prof.saturation_batch(ctx)
    peak = max(prof.throughput(b, ctx) for b in range(1, prof.max_num_seqs + 1))
    assert prof.throughput(sat, ctx) >= 0.9 * peak
    assert sat == 1 or prof.throughput(sat - 1, ctx) < 0.9 * peak
    assert 1 < sat <= prof.max_num_seqs


def test_gpu_profile_grows_with_batch_and_context() -> None:
    gpu = gpu_profile()
    assert gpu.step_s(1, 1000) < gpu.step_s(64, 64_000) < gpu.step_s(256, 256_000)
    assert gpu.step_s(64, 10_000) < gpu.step_s(64, 500_000)


def test_unknown_profile() -> None:
    with pytest.raises(ValueError, match="unknown cost profile 'tpu'"):
        profile("tpu")
