"""Played hosts: Linux network namespaces on a private bridge, one per pod a test plays.

In a cluster every pod is its own host with its own address; local processes all share
``127.0.0.1``, which hides every bug of the kind "this only works from the same machine"
(a Ray driver without a node of its own, a server bound to loopback, a name that only
resolves here). :class:`TestHosts` gives each played pod a network namespace of its own:

* a bridge ``<tag>b`` in the root namespace holding the gateway address ``.1`` of a private
  ``/24`` (chosen so that it overlaps no route or address of this machine), so processes in
  the root namespace (the operator, the test itself) reach the hosts at that address and the
  hosts reach them;
* per host a namespace ``<tag>-<host>`` with ``lo`` up and a veth pair: one end on the
  bridge, the other renamed ``eth0`` inside the namespace with the host's address. No
  default route: traffic goes only to the hosts and the bridge, never out of the machine;
* each process started in a host (:meth:`TestHosts.popen`) also gets a UTS namespace whose
  hostname is the host's name and a PID namespace of its own (``unshare --uts --pid --fork
  --mount-proc``), as a container would: it cannot find other hosts' processes (Ray looks
  for a raylet on "this host" with ``ps``: without this the driver would find one of
  another host and hide the very bug these hosts exist to show), and when it exits,
  everything it left running in its PID namespace is killed by the kernel. The filesystem is
  shared: give each host its own folders (Ray: ``--temp-dir``);
* ``/etc/netns/<namespace>/hosts`` (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/*`` over
  ``/etc``) mapping each host's name and any extra names (Service DNS names such as
  ``<svc>.<ns>.svc`` and ``<svc>.<ns>.svc.cluster.local``) to the hosts' addresses, and a
  ``resolv.conf`` without nameservers so an unknown name fails at once instead of leaving
  the machine.

Names carry a tag ``rp<pid>x<n>`` (pid and instance counter in base 36: interface names are
limited to 15 characters), so parallel runs never collide; leftovers of dead runs (a test
killed before its teardown) are removed on the next start by parsing the pid out of the tag.

Everything is done with the ``ip`` tool (iproute2) and needs ``CAP_SYS_ADMIN`` (namespaces,
bind mounts) and ``CAP_NET_ADMIN`` (links, addresses); without them :class:`NetnsUnavailable`
says which is missing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

__all__ = [
    "Host",
    "NetnsUnavailable",
    "TestHosts",
    "choose_subnet",
    "hosts_file",
    "is_leftover",
    "parse_tag",
    "tag_for",
]

ETC_NETNS = Path("/etc/netns")
RUN_NETNS = Path("/run/netns")
TAG_PREFIX = "rp"
#: Where subnets are chosen from (a /16 of RFC 1918 space, /24 each).
SUBNET_POOL = ipaddress.IPv4Network("10.213.0.0/16")
_TAG_RE = re.compile(rf"^{TAG_PREFIX}([0-9a-z]+)x([0-9a-z]+)")
_HOST_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")
_instances = itertools.count()


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (no ``ip`` tool, or missing capabilities)."""


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def tag_for(pid: int, instance: int) -> str:
    """The name prefix of one :class:`TestHosts`: ``rp<pid>x<instance>`` in base 36."""
    return f"{TAG_PREFIX}{_b36(pid)}x{_b36(instance)}"


def parse_tag(name: str) -> int | None:
    """The pid in a name made by :func:`tag_for` (namespace, link or folder), else None."""
    m = _TAG_RE.match(name)
    return int(m.group(1), 36) if m else None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_port(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait until ``host:port`` accepts connections (a server started in a host), failing
    early when ``proc``, the server's process, exits."""
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args!r} exited with {proc.returncode}"
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{host}:{port} not listening after {timeout}s")


def is_leftover(name: str, alive: object = pid_alive) -> bool:
    """True for a name of ours whose creating process is gone."""
    pid = parse_tag(name)
    return pid is not None and not alive(pid)  # type: ignore[operator]


def choose_subnet(
    taken: Iterable[ipaddress.IPv4Network], start: int = 0,
    pool: ipaddress.IPv4Network = SUBNET_POOL,
) -> ipaddress.IPv4Network:
    """The first /24 of ``pool`` (from index ``start``, wrapping) overlapping none of ``taken``.

    Default routes (``0.0.0.0/0``) must not be in ``taken``: they overlap everything.
    """
    subnets = list(pool.subnets(new_prefix=24))
    taken = [t for t in taken if t.prefixlen > 0]
    for i in range(len(subnets)):
        cand = subnets[(start + i) % len(subnets)]
        if not any(cand.overlaps(t) for t in taken):
            return cand
    raise NetnsUnavailable(f"no free /24 left in {pool}")


def hosts_file(names: Mapping[str, str]) -> str:
    """``/etc/hosts`` content: loopback, then ``address name...`` per address (sorted)."""
    by_addr: dict[str, list[str]] = {}
    for name, addr in names.items():
        by_addr.setdefault(addr, []).append(name)
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    for addr in sorted(by_addr, key=ipaddress.IPv4Address):
        lines.append(f"{addr}\t" + " ".join(sorted(by_addr[addr])))
    return "\n".join(lines) + "\n"


@dataclass
class Host:
    """One played host: its namespace, address and the processes started in it."""

    name: str
    netns: str
    address: str
    veth: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def netns_inode(self) -> int:
        """Identity of the namespace: the inode ``/proc/<pid>/ns/net`` has in it."""
        return os.stat(RUN_NETNS / self.netns).st_ino


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise subprocess.CalledProcessError(res.returncode, argv, res.stdout, res.stderr)
    return res


def _json(*argv: str) -> list[dict[str, object]]:
    out = _run(*argv).stdout
    return json.loads(out) if out.strip() else []


class TestHosts:
    """Played hosts on a private bridge; a context manager (see the module docstring).

    ``add("head")`` makes a host, ``alias("head", "job-head.ns.svc")`` maps more names to it,
    ``popen("head", [...], env=...)`` runs a process in it. Leaving the context (also on an
    exception) kills every process started in the hosts and removes every namespace, link and
    ``/etc/netns`` folder it made.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, kill_grace_s: float = 5.0) -> None:
        self.tag = tag_for(os.getpid(), next(_instances))
        self.kill_grace_s = kill_grace_s
        self.hosts: dict[str, Host] = {}
        self.names: dict[str, str] = {}
        self.subnet: ipaddress.IPv4Network | None = None
        self.bridge = f"{self.tag}b"
        self._bridge_made = False
        self._next = 0  # hosts made so far (addresses and link names are never reused)

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def gateway(self) -> str:
        """The bridge's address in the root namespace (reachable from every host)."""
        assert self.subnet is not None, "TestHosts not started"
        return str(self.subnet.network_address + 1)

    def __enter__(self) -> TestHosts:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> TestHosts:
        self._check_tools()
        remove_leftovers()
        try:
            self.subnet = choose_subnet(self._taken(), start=os.getpid() % 256)
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            self._bridge_made = True
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        except subprocess.CalledProcessError as err:
            self.close()
            raise NetnsUnavailable(
                f"cannot create the bridge {self.bridge} (`{' '.join(err.cmd)}` needs "
                f"CAP_NET_ADMIN): {(err.stderr or '').strip()}") from err
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def _check_tools() -> None:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("the `ip` tool (iproute2) is not installed")
        probe = f"{tag_for(os.getpid(), 999999)}-probe"
        res = _run("ip", "netns", "add", probe, check=False)
        if res.returncode != 0:
            raise NetnsUnavailable(
                "cannot create a network namespace (`ip netns add` needs CAP_SYS_ADMIN, "
                f"links need CAP_NET_ADMIN; running as uid {os.geteuid()}): "
                f"{res.stderr.strip()}")
        _run("ip", "netns", "del", probe, check=False)

    @staticmethod
    def _taken() -> list[ipaddress.IPv4Network]:
        taken = []
        for r in _json("ip", "-j", "-4", "route", "show", "table", "all"):
            dst = str(r.get("dst", ""))
            if dst and dst != "default":
                with contextlib.suppress(ValueError):
                    taken.append(ipaddress.IPv4Network(dst, strict=False))
        for link in _json("ip", "-j", "-4", "addr"):
            for a in link.get("addr_info", []):  # type: ignore[attr-defined]
                taken.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}",
                                                   strict=False))
        return taken

    def close(self) -> None:
        """Kill the hosts' processes; remove namespaces, links, folders (idempotent)."""
        for h in self.hosts.values():
            for p in h.procs:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace_s
        for h in self.hosts.values():
            for p in h.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                if p.poll() is None:
                    _signal_group(p, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=5)
        for h in self.hosts.values():
            _remove_netns(h.netns)
            _run("ip", "link", "del", h.veth, check=False)
        self.hosts.clear()
        if self._bridge_made:
            _run("ip", "link", "del", self.bridge, check=False)
            self._bridge_made = False

    # --- hosts -----------------------------------------------------------------------------

    def add(self, name: str, aliases: Sequence[str] = ()) -> Host:
        """A new host called ``name`` (a DNS label) with the next free address."""
        assert self.subnet is not None, "TestHosts not started"
        if not _HOST_RE.match(name):
            raise ValueError(f"host name {name!r}: lowercase letters, digits and '-' only")
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        i = self._next
        self._next += 1
        if i + 2 >= self.subnet.num_addresses - 1:
            raise ValueError(f"no address left in {self.subnet}")
        address = str(self.subnet.network_address + 2 + i)
        netns = f"{self.tag}-{name}"
        veth, peer = f"{self.tag}h{_b36(i)}", f"{self.tag}p{_b36(i)}"
        host = Host(name=name, netns=netns, address=address, veth=veth)
        self.hosts[name] = host
        _run("ip", "netns", "add", netns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", netns)
        _run("ip", "link", "set", veth, "master", self.bridge)
        _run("ip", "link", "set", veth, "up")
        ns = ("ip", "-n", netns)
        _run(*ns, "link", "set", "lo", "up")
        _run(*ns, "link", "set", peer, "name", "eth0")
        _run(*ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _run(*ns, "link", "set", "eth0", "up")
        self.names[name] = address
        for a in aliases:
            self.names[a] = address
        self._write_etc()
        return host

    def alias(self, host: str, *names: str) -> None:
        """Make ``names`` resolve to ``host``'s address in every host."""
        self.map_names({n: self.hosts[host].address for n in names})

    def map_names(self, names: Mapping[str, str]) -> None:
        """Make each name resolve to its address in every host (e.g. a Service name to the
        gateway, where a process of the root namespace serves it)."""
        if any(self.names.get(n) != a for n, a in names.items()):
            self.names.update(names)
            self._write_etc()

    def remove(self, name: str) -> None:
        """Kill ``name``'s processes and remove the host (a pod deleted for good); the names
        that resolved to it stop resolving."""
        h = self.hosts.pop(name)
        for p in h.procs:
            _signal_group(p, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        _remove_netns(h.netns)
        _run("ip", "link", "del", h.veth, check=False)
        self.names = {n: a for n, a in self.names.items() if a != h.address}
        self._write_etc()

    def _write_etc(self) -> None:
        content = hosts_file(self.names)
        for h in self.hosts.values():
            folder = ETC_NETNS / h.netns
            folder.mkdir(parents=True, exist_ok=True)
            # written in place: a process already in the namespace has the file bind-mounted,
            # and a rename would leave it the old inode
            with open(folder / "hosts", "w") as f:
                f.write(content)
            (folder / "resolv.conf").write_text("options timeout:1 attempts:1\n")

    def address(self, host: str) -> str:
        return self.hosts[host].address

    # --- processes ---------------------------------------------------------------------------

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run in ``host``'s network namespace (``ip netns exec``), in new
        UTS (hostname: the host's name, as a pod's is its own) and PID namespaces (see the
        module docstring); without ``unshare`` only the network namespace."""
        h = self.hosts[host]
        wrapped = ["ip", "netns", "exec", h.netns]
        if shutil.which("unshare") and shutil.which("hostname"):
            wrapped += ["unshare", "--uts", "--pid", "--fork", "--mount-proc", "--kill-child",
                        "sh", "-c", 'hostname "$0" && exec "$@"', h.name]
        return [*wrapped, *argv]

    def popen(
        self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``host``; it is killed (with its process group) on close."""
        h = self.hosts[host]
        p: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            self.argv(host, argv), env=None if env is None else dict(env),
            start_new_session=True, **kwargs)
        h.procs.append(p)
        return p

    def run(
        self, host: str, argv: Sequence[str], timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(host, argv), capture_output=True, text=True,
                              timeout=timeout)


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)


def _remove_netns(netns: str) -> None:
    """Kill whatever still runs in ``netns`` (daemons that left the process group), then
    delete it and its /etc/netns folder."""
    if (RUN_NETNS / netns).exists():
        for _ in range(50):
            pids = [int(x) for x in _run("ip", "netns", "pids", netns,
                                         check=False).stdout.split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        _run("ip", "netns", "del", netns, check=False)
    shutil.rmtree(ETC_NETNS / netns, ignore_errors=True)


def remove_leftovers() -> list[str]:
    """Remove namespaces, links and /etc/netns folders of runs whose process is gone."""
    removed = []
    ns_names = {line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines()
                if line.strip()}
    if ETC_NETNS.is_dir():
        ns_names |= {p.name for p in ETC_NETNS.iterdir()}
    for ns in sorted(ns_names):
        if is_leftover(ns):
            _remove_netns(ns)
            removed.append(ns)
    for link in _json("ip", "-j", "link"):
        name = str(link.get("ifname", ""))
        if is_leftover(name):
            _run("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed
