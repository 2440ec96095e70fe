"""The testbed: :class:`Testbed`, :class:`Host` and :class:`HostSpec` (see the package doc)."""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from distrun.testing.hosts import netns
from distrun.testing.hosts.netns import ETC_NETNS, NETNS_DIR, PREFIX, TestbedError, sweep

__all__ = ["ADDRESS_PREFIXES", "Host", "HostSpec", "Listener", "Testbed", "unavailable"]

#: the first three octets of network 0 (eth0, br0) and network 1 (eth1, br1); host K is .K+1
ADDRESS_PREFIXES = ("198.18.0", "198.19.0")
LOOPBACK_NAME_ADDRESS = "127.0.1.1"
_HEADER = "# distrun testbed host:"  # first line of each host's hosts file: its facts
_counter = itertools.count()
_live: dict[str, Testbed] = {}  # this process's testbeds that are up, downed at exit


@dataclass(frozen=True)
class HostSpec:
    """How one host is built; the defaults give a plain cluster node.

    ``own_name``: what the host's own name resolves to in its own hosts file: its address,
    ``"loopback"`` (127.0.1.1) or ``"second"`` (its address on network 1; needs
    ``second_net``). Every other host always resolves it to its network-0 address.
    ``second_net``: a second interface, ``eth1``, on network 1 (bridge ``br1``).
    ``rate``: shape its cable from the start (a tc rate, e.g. ``"1gbit"``, ``"8mbit"``).
    """

    own_name: Literal["address", "loopback", "second"] = "address"
    second_net: bool = False
    rate: str | None = None

    def __post_init__(self) -> None:
        if self.own_name not in ("address", "loopback", "second"):
            raise ValueError(f"own_name must be address, loopback or second, not "
                             f"{self.own_name!r}")
        if self.own_name == "second" and not self.second_net:
            raise ValueError("own_name='second' needs second_net=True")


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket: its address and port, and the processes holding it."""

    address: str  # "0.0.0.0", "::" or "*" for every interface
    port: int
    processes: tuple[tuple[str, int], ...]  # (command name, pid)

    @property
    def everywhere(self) -> bool:
        return self.address in ("0.0.0.0", "::", "*")


def _burst(rate: str) -> str:
    """A token bucket's size for ``rate``: 10 ms of traffic, at least 16 KB (tbf needs more
    than one tick's worth of bytes at the kernel's timer rate)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: give a number and a unit such as 8mbit, 1gbit, 10mbps")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    per_second = float(m.group(1)) * scale / (8 if m.group(3) == "bit" else 1)
    return str(max(16_000, int(per_second / 100)))


@dataclass
class Host:
    """Host ``index`` of a testbed: run commands on it, and break it."""

    testbed: Testbed
    index: int
    name: str  # its host name, as every hosts file of the testbed knows it
    netns: str  # its network namespace (`ip netns list`)
    address: str  # on network 0 (eth0)
    address2: str | None = None  # on network 1 (eth1), when it has one
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    # ---- running things --------------------------------------------------------------------

    def command(self, argv: Sequence[str], hostname: str | None = None) -> list[str]:
        """The command line that runs ``argv`` on this host (its namespace, hosts file and
        host name; ``hostname`` overrides the name for this command only)."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', hostname or self.name, *argv]

    def popen(self, argv: Sequence[str], *, env: dict[str, str] | None = None,
              hostname: str | None = None, **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on this host in its own session (``env`` replaces the environment,
        as in Popen). Other keywords go to :class:`subprocess.Popen`; the process is killed at
        :meth:`Testbed.down` if still running."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(argv, hostname), env=env, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float = 60.0,
            env: dict[str, str] | None = None, hostname: str | None = None,
            check: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to its end, its output captured as text (other keywords,
        such as ``cwd``, go to :func:`subprocess.run`)."""
        return subprocess.run(self.command(argv, hostname), env=env, capture_output=True,
                              text=True, timeout=timeout, check=check, start_new_session=True,
                              **kwargs)

    def pids(self) -> list[int]:
        """Every live process on this host."""
        ns = netns.identity(os.path.join(NETNS_DIR, self.netns))
        return netns.pids_in(ns) if ns else []

    def kill_all(self) -> list[int]:
        """Node loss: SIGKILL every process on this host; their pids. The host stays up (a
        machine that rebooted), so new processes may be started on it."""
        killed = netns.kill_all_in(netns.identity(os.path.join(NETNS_DIR, self.netns)))
        self._reap()
        return killed

    def _reap(self, timeout: float = 10.0) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pass  # still running: down() kills its namespace
        self._procs = [p for p in self._procs if p.returncode is None]

    # ---- the cable -------------------------------------------------------------------------

    def _ends(self, net: int | None) -> list[tuple[str, str]]:
        """(namespace, interface) of both ends of the host's cables on ``net`` (None: all)."""
        nets = [0, 1] if net is None else [net]
        out = []
        for n in nets:
            if n == 1 and self.address2 is None:
                if net == 1:
                    raise ValueError(f"{self.name} has no interface on network 1")
                continue
            out += [(self.netns, f"eth{n}"), (self.testbed.switch, f"{'pq'[n]}{self.index}")]
        return out

    def cut(self, net: int | None = None) -> None:
        """Partition: pull the host's cable at the switch (network ``net``, default all)."""
        for ns, dev in self._ends(net)[1::2]:
            netns.tool("ip", "-n", ns, "link", "set", dev, "down")

    def restore(self, net: int | None = None) -> None:
        """Plug the cable back in."""
        for ns, dev in self._ends(net)[1::2]:
            netns.tool("ip", "-n", ns, "link", "set", dev, "up")

    def shape(self, rate: str, net: int | None = 0) -> None:
        """Limit the host's cable to ``rate`` (e.g. ``"1gbit"``) in both directions."""
        burst = _burst(rate)
        for ns, dev in self._ends(net):
            netns.tool("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                 "burst", burst, "latency", "50ms")

    def unshape(self, net: int | None = None) -> None:
        """Take the rate limit off (the cable's default queue again)."""
        for ns, dev in self._ends(net):
            netns.tool("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)

    def link(self, net: int = 0) -> dict[str, str]:
        """The cable's state: ``{"switch": "UP" or "DOWN", "rate": "8Mbit" or "none"}``."""
        _, (sw_ns, port) = self._ends(net)
        state = netns.tool("ip", "-n", sw_ns, "-br", "link", "show", "dev", port).split()
        qdisc = netns.tool("tc", "-n", self.netns, "qdisc", "show", "dev", f"eth{net}").strip()
        rate = re.search(r" tbf .* rate (\S+)", qdisc)
        return {"switch": state[1] if len(state) > 1 else "?",
                "rate": rate.group(1) if rate else "none"}

    # ---- what is on it ---------------------------------------------------------------------

    def listening(self) -> list[Listener]:
        """This host's listening TCP sockets and their processes (``ss -ltnp`` inside it)."""
        out = []
        text = netns.tool("ip", "netns", "exec", self.netns, "ss", "-H", "-l", "-t", "-n", "-p")
        for line in text.splitlines():
            cols = line.split()
            if len(cols) < 5:
                continue
            addr, _, port = cols[3].rpartition(":")
            addr = addr.strip("[]").split("%", 1)[0]
            procs = tuple((n, int(p)) for n, p in re.findall(r'\("([^"]*)",pid=(\d+)', line))
            out.append(Listener(addr, int(port), procs))
        return out


class Testbed:
    """N hosts on a bridge; see the module docstring. Use :meth:`up`, then :meth:`down`."""

    __test__ = False

    def __init__(self, bed_id: str, hosts: list[Host] | None = None) -> None:
        self.id = bed_id
        self.hosts: list[Host] = hosts or []

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.id}-switch"

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def __repr__(self) -> str:
        return f"Testbed({self.id!r}, {[h.name for h in self.hosts]})"

    # ---- building --------------------------------------------------------------------------

    @classmethod
    def up(cls, hosts: int | Sequence[HostSpec] = 2, *, label: str | None = None) -> Testbed:
        """Build a testbed of ``hosts`` (a count, or one :class:`HostSpec` per host).

        Without ``label`` it belongs to this process: removed at :meth:`down` or at exit, and
        swept by a later process once this one is dead. With ``label`` (the CLI's) it stays
        until ``down``. Stale testbeds of dead processes are swept first.
        """
        specs = [HostSpec() for _ in range(hosts)] if isinstance(hosts, int) else list(hosts)
        if not 1 <= len(specs) <= 250:
            raise ValueError(f"a testbed has 1 to 250 hosts, not {len(specs)}")
        if label is not None and not netns.LABEL.fullmatch(label):
            raise ValueError(f"label {label!r}: a lowercase letter, then up to 15 lowercase "
                             "letters or digits")
        sweep()
        bed = cls(label if label is not None else f"{os.getpid()}-{next(_counter)}")
        if label is not None and os.path.exists(os.path.join(NETNS_DIR, bed.switch)):
            raise TestbedError(f"testbed {label!r} is up already (`python -m "
                               f"distrun.testing.hosts down --label {label}` first)")
        if label is None:
            _live[bed.id] = bed
            netns.live_ids.add(bed.id)
        try:
            bed._build(specs)
        except BaseException:
            bed.down()
            raise
        return bed

    def _build(self, specs: list[HostSpec]) -> None:
        sw = self.switch
        netns.add(sw)
        netns.tool("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        netns.tool("ip", "-n", sw, "link", "set", "br0", "up")
        if any(s.second_net for s in specs):
            netns.tool("ip", "-n", sw, "link", "add", "br1", "type", "bridge")
            netns.tool("ip", "-n", sw, "link", "set", "br1", "up")
        for k, spec in enumerate(specs):
            host = Host(self, k, f"host{k}", f"{PREFIX}{self.id}-host{k}",
                        f"{ADDRESS_PREFIXES[0]}.{k + 1}",
                        f"{ADDRESS_PREFIXES[1]}.{k + 1}" if spec.second_net else None)
            self.hosts.append(host)
            netns.add(host.netns)
            netns.tool("ip", "-n", host.netns, "link", "set", "lo", "up")
            for net in (0, 1) if spec.second_net else (0,):
                port, dev = f"{'pq'[net]}{k}", f"eth{net}"
                netns.tool("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name",
                           dev, "netns", host.netns)
                netns.tool("ip", "-n", sw, "link", "set", port, "master", f"br{net}")
                netns.tool("ip", "-n", sw, "link", "set", port, "up")
                netns.tool("ip", "-n", host.netns, "addr", "add",
                           f"{host.address if net == 0 else host.address2}/24", "dev", dev)
                netns.tool("ip", "-n", host.netns, "link", "set", dev, "up")
            if spec.rate:
                host.shape(spec.rate, net=None)
        for host, spec in zip(self.hosts, specs):
            self._write_hosts_file(host, spec)

    def _write_hosts_file(self, host: Host, spec: HostSpec) -> None:
        own = {"address": host.address, "loopback": LOOPBACK_NAME_ADDRESS,
               "second": host.address2}[spec.own_name]
        lines = [f"{_HEADER} {host.name} {host.address} {host.address2 or '-'} "
                 f"{spec.own_name}",
                 "127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{own if h is host else h.address} {h.name}" for h in self.hosts]
        folder = os.path.join(ETC_NETNS, host.netns)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hosts"), "w") as fh:
            fh.write("\n".join(lines) + "\n")

    @classmethod
    def attach(cls, label: str) -> Testbed:
        """The persistent testbed ``label`` made earlier (by the CLI), read back from its
        namespaces and hosts files."""
        bed = cls(label)
        if not os.path.exists(os.path.join(NETNS_DIR, bed.switch)):
            raise TestbedError(f"no testbed {label!r} is up (`python -m distrun.testing.hosts "
                               "up N` makes one)")
        found = [(m, name) for name in netns.names_in(NETNS_DIR)
                 if (m := netns.NAME.match(name)) and m["bed"] == label and m["index"]]
        for m, name in sorted(found, key=lambda f: int(f[0]["index"])):
            try:
                with open(os.path.join(ETC_NETNS, name, "hosts")) as fh:
                    facts = fh.readline().removeprefix(_HEADER).split()
            except OSError:
                continue
            bed.hosts.append(Host(bed, int(m["index"]), facts[0], name, facts[1],
                                  None if facts[2] == "-" else facts[2]))
        return bed

    # ---- removing --------------------------------------------------------------------------

    def down(self) -> None:
        """Kill every process of every host, delete the namespaces and hosts files.

        Raises :class:`TestbedError` if something could not be removed (after trying all).
        """
        problems = []
        names = [h.netns for h in self.hosts] + [self.switch]
        for host in self.hosts:
            try:
                host.kill_all()
            except TestbedError as exc:
                problems.append(str(exc))
        for name in names:
            problems += netns.remove(name)
        _live.pop(self.id, None)
        netns.live_ids.discard(self.id)
        if problems:
            raise TestbedError(f"testbed {self.id} not fully removed: {'; '.join(problems)}")


def unavailable() -> str | None:
    """Why testbeds cannot be made here (None when they can): tried for real, once."""
    if not _why:
        _why.append(_probe())
    return _why[0]


_why: list[str | None] = []


def _probe() -> str | None:
    missing = [t for t in ("ip", "tc", "ss", "unshare") if shutil.which(t) is None]
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's (this is {sys.platform})"
    if missing:
        return f"{', '.join(missing)} not found (apt-get install iproute2 util-linux)"
    try:
        with Testbed.up(1) as bed:
            bed[0].run(["true"], check=True)
    except (TestbedError, OSError, subprocess.SubprocessError) as exc:
        return (f"cannot make a network namespace ({str(exc).strip()[:200]}); it needs root "
                "or CAP_NET_ADMIN and CAP_SYS_ADMIN")
    return None


@atexit.register
def _down_at_exit() -> None:
    for bed in list(_live.values()):
        try:
            bed.down()
        except TestbedError:
            pass

