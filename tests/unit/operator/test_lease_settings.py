"""Leader election over the in-memory API server, and the operator's settings."""

from __future__ import annotations

import asyncio

import pytest
from operator_fakekube import FakeKube

from rlpacer.operator import lease as lease_mod
from rlpacer.operator.lease import LeaderElector
from rlpacer.operator.settings import OperatorSettings

pytestmark = pytest.mark.unit


def _elector(fk: FakeKube, who: str) -> LeaderElector:
    return LeaderElector(fk, "sys", "rlpacer", who, duration=10, renew=2, retry=1)  # type: ignore[arg-type]


def test_one_leader_takeover_after_silence_and_on_release(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(lease_mod.time, "monotonic", lambda: clock[0])

    async def body() -> None:
        fk = FakeKube()
        a, b = _elector(fk, "a"), _elector(fk, "b")
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
        clock[0] += 5
        assert await a.try_acquire_or_renew()  # renewed: b's view of the record changes
        clock[0] += 9
        assert not await b.try_acquire_or_renew()  # silent only 9 s on b's clock
        clock[0] += 11
        assert await b.try_acquire_or_renew()  # a silent for > duration: b takes over
        assert not await a.try_acquire_or_renew()
        lease = next(iter(fk.of_kind("leases")))
        assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
        await b.release()
        assert await a.try_acquire_or_renew()  # released: no need to wait

    asyncio.run(body())


def test_settings_from_env_and_flags() -> None:
    env = {
        "RLPACER_OPERATOR_NAMESPACES": "a, b",
        "RLPACER_OPERATOR_REPORT_PORT": "9000",
        "RLPACER_OPERATOR_LEADER_ELECTION": "false",
        "RLPACER_OPERATOR_OPERATOR_NAMESPACE": "sys",
    }
    s = OperatorSettings.load(env, {"report_port": "9100"})
    assert s.namespaces == ["a", "b"] and s.report_port == 9100 and not s.leader_election
    assert s.pod_report_url() == "http://rlpacer-operator.sys.svc:9100"
    with pytest.raises(SystemExit, match="report_port"):
        OperatorSettings.load({"RLPACER_OPERATOR_REPORT_PORT": "x"})
    with pytest.raises(SystemExit, match="lease_renew_seconds"):
        OperatorSettings.load({}, {"lease_renew_seconds": 20})
