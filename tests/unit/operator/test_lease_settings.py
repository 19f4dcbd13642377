"""Leader election over the in-memory API server, and the operator's settings."""

from __future__ import annotations

import asyncio
from typing import Any

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


def test_a_renewal_that_hangs_loses_leadership_within_the_lease() -> None:
    """An API server whose etcd is away holds requests open (up to its own timeout): the
    leader must stop acting when its Lease could expire, not when the request gives up."""

    class Hanging(FakeKube):
        hang = False

        async def get(self, path: str) -> Any:
            if self.hang:
                await asyncio.sleep(3600)
            return await super().get(path)

    async def body() -> float:
        fk = Hanging()
        a = LeaderElector(fk, "sys", "rlpacer", "a", duration=1.0, renew=0.2,  # type: ignore[arg-type]
                          retry=0.1)
        assert await a.try_acquire_or_renew()
        fk.hang = True
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(a.hold(), timeout=10)
        return loop.time() - t0

    lost_after = asyncio.run(body())
    assert 0.9 <= lost_after <= 1.6, lost_after


def test_settings_from_env_and_flags() -> None:
    env = {
        "RLPACER_OPERATOR_NAMESPACES": "a, b",
        "RLPACER_OPERATOR_REPORT_PORT": "9000",
        "RLPACER_OPERATOR_LEADER_ELECTION": "false",
        "RLPACER_OPERATOR_OPERATOR_NAMESPACE": "sys",
    }
    s = OperatorSettings.load(env, {"report_port": "9100"})
    assert s.namespaces == ["a", "b"] and s.report_port == 9100 and not s.leader_election
    assert s.pod_report_url() == "https://rlpacer-operator.sys.svc:9100"
    assert OperatorSettings.load({}, {"namespaces": ["a,b", " c"]}).namespaces == ["a", "b", "c"]
    insecure = OperatorSettings.load(env, {"report_insecure_http": True})
    assert insecure.pod_report_url() == "http://rlpacer-operator.sys.svc:9000"
    with pytest.raises(SystemExit, match="report_port"):
        OperatorSettings.load({"RLPACER_OPERATOR_REPORT_PORT": "x"})
    with pytest.raises(SystemExit, match="lease_renew_seconds"):
        OperatorSettings.load({}, {"lease_renew_seconds": 20})


def test_report_tls_settings_are_checked_at_load() -> None:
    """TLS is the default; plain HTTP only when asked for, and a report URL whose scheme
    contradicts what is served fails the start, naming the fix."""
    with pytest.raises(SystemExit, match=r"report_url 'http://op:1' must start with https://"
                                         r".*set report_insecure_http"):
        OperatorSettings.load({}, {"report_url": "http://op:1"})
    with pytest.raises(SystemExit, match=r"must start with http://.*unset report_insecure_http"):
        OperatorSettings.load({}, {"report_url": "https://op:1", "report_insecure_http": True})
    with pytest.raises(SystemExit, match="report_cert_dir and report_insecure_http exclude"):
        OperatorSettings.load({"RLPACER_OPERATOR_REPORT_CERT_DIR": "/c",
                               "RLPACER_OPERATOR_REPORT_INSECURE_HTTP": "true"})
    s = OperatorSettings.load({"RLPACER_OPERATOR_OPERATOR_NAMESPACE": "sys"},
                              {"report_url": "https://10.0.0.5:8443"})
    names = s.report_hostnames()
    assert names[0] == "rlpacer-operator.sys.svc" and "10.0.0.5" in names
    assert "127.0.0.1" in names


def test_job_network_policy_settings_from_env_and_flags() -> None:
    assert OperatorSettings.load({}).job_network() is None  # off by default
    peer = '[{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "rlpacer"}}}]'
    s = OperatorSettings.load({
        "RLPACER_OPERATOR_JOB_NETWORK_POLICY": "true",
        "RLPACER_OPERATOR_JOB_REPORT_TO": peer,
        "RLPACER_OPERATOR_REPORT_URL": "https://rlpacer.sys.svc:443",
    })
    net = s.job_network()
    assert net is not None
    # the operator's container port and the URL's (the Service's) port
    assert net.report_ports == (8080, 443)
    assert net.report_to == ({"podSelector": {"matchLabels": {"app.kubernetes.io/name":
                                                              "rlpacer"}}},)
    assert net.egress == ()
    # a flag: the JSON array, as in env; one port when the URL's is the container port
    flagged = OperatorSettings.load({}, {"job_network_policy": True,
                                         "job_egress": ['[{"ports": [{"port": 443}]}]']})
    net = flagged.job_network()
    assert net is not None and net.report_ports == (8080,)
    assert net.egress == ({"ports": [{"port": 443}]},)


@pytest.mark.parametrize(("env", "message"), [
    ({"RLPACER_OPERATOR_JOB_EGRESS": "[{"},
     r"RLPACER_OPERATOR_JOB_EGRESS: not JSON .*give a JSON array"),
    ({"RLPACER_OPERATOR_JOB_EGRESS": '[{"to": [{"cidr": "10.0.0.0/8"}]}]'},
     r"job_egress\[0\]\.to\[0\]: .* is not a NetworkPolicy peer; give an object with ipBlock"),
    ({"RLPACER_OPERATOR_JOB_EGRESS": '[{"port": 443}]'},
     r"job_egress\[0\]: .*unknown: port.*ports and/or to"),
    ({"RLPACER_OPERATOR_JOB_REPORT_TO": '[{}]'}, r"job_report_to\[0\]: \{\} .*\(empty\)"),
    ({"RLPACER_OPERATOR_JOB_REPORT_TO": '{"podSelector": {}}'}, r"job_report_to"),
])
def test_bad_job_network_policy_settings_fail_at_start_with_the_field(
        env: dict[str, str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        OperatorSettings.load(env)
