"""Several "hosts" on one Linux machine: network namespaces joined by a bridge (torch-free).

A :class:`Testbed` of N hosts looks like a small cluster. Each host is a network namespace
``distrun-<id>-host<K>`` with its loopback up, one interface ``eth0`` at ``198.18.0.<K+1>/24``
(the benchmarking range RFC 2544 sets aside, which nothing here routes) and no default route,
so nothing it sends can leave the testbed. Its ``eth0`` is one end of a veth pair; the other
end, ``p<K>``, is a port of the bridge ``br0`` inside one more namespace,
``distrun-<id>-switch``. The root namespace gets no interface at all: interface names only
have to be unique inside a namespace, and two testbeds (two pytest processes) never meet.

Every command run on host K (:meth:`Host.popen`) goes through ``ip netns exec`` (which
bind-mounts ``/etc/netns/<netns>/hosts`` over ``/etc/hosts``) and ``unshare --uts`` (its own
host name, ``host<K>``), as its own session. The hosts file maps every host's name to its
address, as a cluster's DNS would.

Faults a test (or a person) can cause:

- node loss: :meth:`Host.kill_all` SIGKILLs every process whose network namespace is the
  host's (found through ``/proc/PID/ns/net``, so grandchildren and daemons go too);
- partition: :meth:`Host.cut` sets the switch side of the host's cable down (packets both
  ways are dropped silently, no reset reaches anyone: a pulled cable), :meth:`Host.restore`;
- slow network: :meth:`Host.shape` puts a token bucket (``tc ... tbf``) on both ends of the
  cable, since tc only shapes what leaves an interface; :meth:`Host.unshape`;
- the classic init hangs: :class:`HostSpec` ``own_name="loopback"`` makes the host's own
  hosts file map its name to 127.0.1.1 (as Debian's installer does), ``second_net`` gives it
  a second interface ``eth1`` on a second bridge (``198.19.0.<K+1>``), and
  ``own_name="second"`` maps its name to that second address.

:meth:`Host.listening` lists the host's listening TCP sockets (``ss -ltnp`` inside it).

Cleanup: :meth:`Testbed.down` (also at interpreter exit, and as a context manager) kills the
hosts' processes, deletes the namespaces (the cables and bridges go with them) and the
``/etc/netns`` folders. A testbed whose creator was killed (kill -9 of pytest) is swept by
:func:`sweep` at the next :meth:`Testbed.up`: it is ours by its name, ``distrun-<pid>-<n>``,
and stale when that pid is no longer alive. Testbeds made by ``python -m distrun.testing.hosts
up`` are named ``distrun-<label>-...`` and stay until ``down``.

Modules: ``testbed`` (the hosts), ``netns`` (naming, emptying, removing and sweeping the
namespaces), ``__main__`` (``python -m distrun.testing.hosts``, for humans).

Needs Linux, iproute2 (``ip``, ``tc``, ``ss``), util-linux's ``unshare`` and root (or
CAP_NET_ADMIN and CAP_SYS_ADMIN); :func:`unavailable` says what is missing.
"""

from distrun.testing.hosts.netns import TestbedError, leftovers, sweep
from distrun.testing.hosts.testbed import (
    ADDRESS_PREFIXES,
    Host,
    HostSpec,
    Listener,
    Testbed,
    unavailable,
)

__all__ = ["ADDRESS_PREFIXES", "Host", "HostSpec", "Listener", "Testbed", "TestbedError",
           "leftovers", "sweep", "unavailable"]
