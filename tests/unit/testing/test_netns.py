"""TestHosts' pure parts: name tags (unique, short, pid recoverable), subnet choice, hosts files."""

from __future__ import annotations

import ipaddress

import pytest

from rlpacer.testing import netns

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("pid,inst", [(1, 0), (4194304, 0), (4194304, 1295), (12345, 7)])
def test_tags_round_trip_and_fit_interface_names(pid: int, inst: int) -> None:
    tag = netns.tag_for(pid, inst)
    assert netns.parse_tag(tag) == pid
    assert netns.parse_tag(f"{tag}-head") == pid
    # the longest link name made from a tag (veth end "<tag>h<i>") fits IFNAMSIZ-1 = 15
    assert len(f"{tag}h{'z' * 2}") <= 15


def test_tags_are_distinct_per_pid_and_instance() -> None:
    tags = {netns.tag_for(p, i) for p in (1, 2, 36, 37, 1000) for i in range(40)}
    assert len(tags) == 5 * 40


def test_only_dead_runs_are_leftovers() -> None:
    assert netns.parse_tag("eth0") is None and netns.parse_tag("rpx") is None
    assert not netns.is_leftover("eth0", alive=lambda pid: False)
    assert netns.is_leftover(netns.tag_for(99, 0) + "b", alive=lambda pid: False)
    assert not netns.is_leftover(netns.tag_for(99, 0) + "b", alive=lambda pid: True)


def test_subnet_avoids_every_taken_network() -> None:
    n = ipaddress.IPv4Network
    pool = n("10.213.0.0/22")
    taken = [n("0.0.0.0/0"), n("10.213.0.0/24"), n("10.213.1.128/25")]
    assert netns.choose_subnet(taken, start=0, pool=pool) == n("10.213.2.0/24")
    assert netns.choose_subnet(taken, start=3, pool=pool) == n("10.213.3.0/24")
    # wraps around from the start index
    assert netns.choose_subnet([*taken, n("10.213.3.0/24")], start=3,
                               pool=pool) == n("10.213.2.0/24")
    with pytest.raises(netns.NetnsUnavailable):
        netns.choose_subnet([n("10.0.0.0/8")], pool=pool)


def test_hosts_file_maps_each_address_to_all_its_names() -> None:
    text = netns.hosts_file({"head": "10.1.0.2", "job-head.ns.svc": "10.1.0.2",
                             "rollout": "10.1.0.10", "driver": "10.1.0.3"})
    lines = text.splitlines()
    assert lines[0].split() == ["127.0.0.1", "localhost"]
    assert lines[2:] == ["10.1.0.2\thead job-head.ns.svc", "10.1.0.3\tdriver",
                         "10.1.0.10\trollout"]


def test_a_missing_ip_tool_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    with pytest.raises(netns.NetnsUnavailable, match="iproute2"):
        netns.TestHosts().start()
