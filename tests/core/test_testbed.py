"""The multi-host testbed itself (distrun.testing.hosts): network-namespace hosts on a bridge.

Every check is made from inside the hosts with real sockets: names and addresses, what is
reachable (the other hosts) and what is not (anything else), a cut cable, a shaped one, node
loss, listening sockets, and that nothing is left after a failure, an interrupt or a kill -9
of the process that made the testbed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from distrun._launch.lifeline import pid_alive
from distrun.testing import HostSpec
from distrun.testing.hosts import Testbed, leftovers, sweep, unavailable
from distrun.testing.hosts.netns import ETC_NETNS, NETNS_DIR, names_in

pytestmark = pytest.mark.multihost

ROOT = Path(__file__).resolve().parents[2]

#: a TCP server on a host: accepts one connection, reports each chunk it reads as
#: "<seconds since the first byte> <total bytes>" on stdout, until the peer closes
SERVER = textwrap.dedent("""
    import socket, sys, time
    srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    conn, peer = srv.accept()
    print("peer", peer[0], flush=True)
    total, first = 0, None
    while True:
        data = conn.recv(1 << 16)
        if not data:
            break
        first = first or time.monotonic()
        total += len(data)
        print(f"{time.monotonic() - first:.3f} {total}", flush=True)
    print("closed", flush=True)
""")

#: a TCP client: connects to argv[1]:argv[2], then sends what each line of stdin says
#: ("send N" bytes, "close"), printing "ok" or the error of each step
CLIENT = textwrap.dedent("""
    import socket, sys
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    except OSError as exc:
        print("connect failed:", type(exc).__name__, exc.errno, flush=True)
        sys.exit(0)
    print("connected", flush=True)
    for line in sys.stdin:
        verb, *rest = line.split()
        if verb == "send":
            s.sendall(b"x" * int(rest[0]))
        elif verb == "close":
            s.close()
        print("ok", flush=True)
""")


def _py(host, code: str, *args: str, **kwargs):
    return host.popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True, **kwargs)


def _server(host, port: int = 5000):
    proc = _py(host, SERVER, host.address, str(port), stdin=subprocess.DEVNULL)
    assert proc.stdout.readline().strip() == "listening"
    return proc


def _received(server) -> int:
    """The byte count of the server's next line (after its "peer" line)."""
    words = server.stdout.readline().split()
    if words[0] == "peer":
        words = server.stdout.readline().split()
    return int(words[1])


def _client(host, to: str, port: int = 5000, timeout: float = 30.0):
    proc = _py(host, CLIENT, to, str(port), str(timeout), stdin=subprocess.PIPE)
    return proc, proc.stdout.readline().strip()


def _ask(client, line: str) -> str:
    client.stdin.write(line + "\n")
    client.stdin.flush()
    return client.stdout.readline().strip()


def test_hosts_have_names_addresses_and_reach_only_each_other(distrun_hosts):
    bed = distrun_hosts(3)
    assert [h.name for h in bed] == ["host0", "host1", "host2"]
    assert [h.address for h in bed] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    resolve = ("import socket; n = socket.gethostname(); "
               "print(n, socket.gethostbyname(n), *map(socket.gethostbyname, "
               "['host0', 'host1', 'host2', 'localhost']))")
    for host in bed:
        out = host.run([sys.executable, "-c", resolve], check=True).stdout.split()
        assert out == [host.name, host.address, *[h.address for h in bed], "127.0.0.1"]
    # host2 reaches host1 by name, and host1 sees host2's address as the peer
    server = _server(bed[1])
    client, said = _client(bed[2], "host1")
    assert said == "connected"
    assert _ask(client, "send 1000") == "ok" and _ask(client, "close") == "ok"
    assert server.stdout.readline().split() == ["peer", "198.18.0.3"]
    assert server.stdout.readline().split()[1] == "1000"
    # Nothing outside the testbed has a route: the machine's own addresses, the rest of the
    # world and other testbeds' ranges are refused locally, before any packet is sent.
    routes = bed[0].run(["ip", "route", "show", "table", "all"], check=True).stdout
    assert "default" not in routes
    machine = [a.split("/")[0] for line in subprocess.run(
        ["ip", "-4", "-br", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout.splitlines() if not line.startswith("lo ") for a in line.split()[2:]]
    for address in [*machine, "203.0.113.1", "198.19.0.2"]:
        probe = bed[0].run(["ip", "route", "get", address])
        assert probe.returncode != 0 and "unreachable" in probe.stderr, (address, probe)
        _, said = _client(bed[0], address, timeout=5)
        assert said.startswith("connect failed: OSError 101"), said  # ENETUNREACH


def test_host_specs_loopback_name_and_second_network(distrun_hosts):
    bed = distrun_hosts([HostSpec(), HostSpec(own_name="loopback"),
                         HostSpec(second_net=True, own_name="second")])
    own = "import socket; print(socket.gethostbyname(socket.gethostname()))"
    assert bed[1].run([sys.executable, "-c", own]).stdout.strip() == "127.0.1.1"
    assert bed[2].run([sys.executable, "-c", own]).stdout.strip() == "198.19.0.3"
    # the others resolve both by their network-0 address, as a cluster's DNS would
    peers = "import socket; print(socket.gethostbyname('host1'), socket.gethostbyname('host2'))"
    assert bed[0].run([sys.executable, "-c", peers]).stdout.split() == ["198.18.0.2",
                                                                         "198.18.0.3"]
    links = bed[2].run(["ip", "-br", "-4", "addr"], check=True).stdout
    assert "198.18.0.3/24" in links and "198.19.0.3/24" in links
    assert bed[0].address2 is None and bed[2].address2 == "198.19.0.3"
    # network 1 holds host2 only: host0 has no way to it (the classic wrong interface)
    assert "unreachable" in bed[0].run(["ip", "route", "get", "198.19.0.3"]).stderr


def test_a_host_runs_commands_as_its_own_session_and_loses_them_all(distrun_hosts):
    bed = distrun_hosts(2)
    env = {"PATH": os.environ["PATH"], "TESTBED_PROBE": "42"}
    shell = bed[1].popen(["sh", "-c", 'echo "$TESTBED_PROBE $$"; sleep 300 & sleep 300 & wait'],
                         env=env, stdout=subprocess.PIPE, text=True)
    probe, pid = shell.stdout.readline().split()
    assert probe == "42" and int(pid) == shell.pid  # exec'd through ip, unshare and sh
    assert os.getsid(shell.pid) == shell.pid  # its own session
    # the two sleeps have started once the host holds three processes
    while len(bed[1].pids()) < 3:
        time.sleep(0.05)
    host1 = set(bed[1].pids())
    assert shell.pid in host1 and not host1 & set(bed[0].pids())
    killed = bed[1].kill_all()
    assert set(killed) >= host1
    assert bed[1].pids() == [] and shell.wait(timeout=10) == -signal.SIGKILL
    # the host is still there: a node that rebooted can run the next command
    assert bed[1].run(["hostname"], check=True).stdout.strip() == "host1"


def test_listening_sockets_are_listed_with_their_process(distrun_hosts):
    bed = distrun_hosts(2)
    server = _server(bed[0], 5001)
    wildcard = _py(bed[0], "import socket, time; s = socket.create_server(('', 5002)); "
                           "print('up', flush=True); time.sleep(300)")
    assert wildcard.stdout.readline().strip() == "up"
    found = {(s.address, s.port): s for s in bed[0].listening()}
    assert set(found) == {("198.18.0.1", 5001), ("0.0.0.0", 5002)}
    assert found["198.18.0.1", 5001].processes[0][1] == server.pid
    assert found["0.0.0.0", 5002].everywhere and not found["198.18.0.1", 5001].everywhere
    assert bed[1].listening() == []


def test_a_cut_cable_drops_packets_silently_until_restored(distrun_hosts):
    bed = distrun_hosts(2)
    server = _server(bed[1])
    client, said = _client(bed[0], "host1")
    assert said == "connected"
    assert _ask(client, "send 100") == "ok"
    assert _received(server) == 100
    bed[1].cut()
    assert bed[1].link()["switch"] == "DOWN"
    assert "NO-CARRIER" in bed[1].run(["ip", "link", "show", "eth0"]).stdout
    # a new connection gets no answer at all (not a refusal: nothing reaches host1) ...
    _, said = _client(bed[0], "host1", timeout=2)
    assert said.startswith("connect failed: TimeoutError")
    # ... and bytes sent on the open connection wait in host0's TCP retransmissions
    assert _ask(client, "send 200") == "ok"
    bed[1].restore()
    assert bed[1].link()["switch"] == "UP"
    # the same connection delivers them once the cable is back: no reset, no error
    assert _received(server) == 300
    _, said = _client(bed[0], "host1", port=5000, timeout=30)
    assert said != "connect failed: TimeoutError"  # refused (the server took one peer) or in


def test_a_shaped_cable_limits_the_bandwidth(distrun_hosts):
    bed = distrun_hosts(2)
    rate_bits, size = 16_000_000, 2_000_000  # 16 Mbit/s: 2 MB takes 1 s
    bed[1].shape("16mbit")
    assert bed[1].link()["rate"] == "16Mbit"
    server = _server(bed[1])
    client, said = _client(bed[0], "host1")
    assert said == "connected"
    for _ in range(size // 100_000):
        assert _ask(client, "send 100000") == "ok"
    _ask(client, "close")
    lines = [line.split() for line in server.stdout.read().splitlines()]
    seconds = float(lines[-2][0])
    assert int(lines[-2][1]) == size
    # A token bucket lets at most `burst` bytes through above the rate (16 KB here, one bucket
    # at each end): the kernel cannot deliver faster, however idle or busy the machine is.
    floor = (size - 2 * 20_000) * 8 / rate_bits
    assert seconds >= 0.9 * floor, f"{size} bytes in {seconds:.3f}s through a 16mbit cable"
    stats = bed[1].run(["tc", "-s", "qdisc", "show", "dev", "eth0"], check=True).stdout
    assert " tbf " in stats
    bed[1].unshape()
    assert bed[1].link()["rate"] == "none"


def test_down_removes_everything_also_after_a_failure_inside(tmp_path):
    if unavailable():
        pytest.skip(f"multihost testbed unavailable: {unavailable()}")
    with pytest.raises(RuntimeError, match="boom"), Testbed.up(2) as bed:
        sleeper = bed[0].popen(["sleep", "300"])
        names = [h.netns for h in bed] + [bed.switch]
        assert all(os.path.exists(os.path.join(NETNS_DIR, n)) for n in names)
        raise RuntimeError("boom")
    assert sleeper.poll() == -signal.SIGKILL
    assert not set(names) & (set(names_in(NETNS_DIR)) | set(names_in(ETC_NETNS)))
    assert leftovers() == []


MAKER = textwrap.dedent("""
    import time
    from distrun.testing.hosts import Testbed
    bed = Testbed.up(2)
    sleeper = bed[1].popen(["sleep", "300"])
    # the same process, once ip, unshare and sh have exec'd into sleep
    while open(f"/proc/{sleeper.pid}/comm").read().strip() != "sleep":
        time.sleep(0.02)
    print(bed.id, sleeper.pid, flush=True)
    time.sleep(300)
""")


def test_a_killed_maker_leaves_a_testbed_that_the_next_one_sweeps(distrun_hosts):
    distrun_hosts(1)  # skips where namespaces cannot be made
    maker = subprocess.Popen([sys.executable, "-c", MAKER], stdout=subprocess.PIPE, text=True)
    try:
        bed_id, sleeper = maker.stdout.readline().split()
    finally:
        maker.kill()  # kill -9: no atexit, no finally
        maker.wait()
    ours = [n for n in names_in(NETNS_DIR) if n.startswith(f"distrun-{bed_id}-")]
    assert len(ours) == 3 and all(n in names_in(ETC_NETNS) for n in ours if "host" in n)
    assert set(ours) <= set(leftovers())  # the session-end check would see them
    assert pid_alive(int(sleeper))  # its sleep outlived it
    swept = sweep()
    assert set(ours) <= set(swept)
    assert not [n for n in names_in(NETNS_DIR) + names_in(ETC_NETNS) if bed_id in n]
    assert not pid_alive(int(sleeper))


INTERRUPTED = textwrap.dedent("""
    import os, signal, subprocess

    def test_fails(distrun_hosts):
        bed = distrun_hosts(2)
        bed[0].popen(["sleep", "300"])
        assert False, "a failing test"

    def test_interrupted(distrun_hosts):
        bed = distrun_hosts(2)
        bed[1].popen(["sleep", "300"])
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the test
""")


def test_pytest_removes_the_testbeds_of_failed_and_interrupted_tests(distrun_hosts, tmp_path):
    distrun_hosts(1)  # skips where namespaces cannot be made
    (tmp_path / "test_it.py").write_text(INTERRUPTED)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                             "-m", "multihost", str(tmp_path / "test_it.py")], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=120)
    assert "1 failed" in out and "KeyboardInterrupt" in out, out
    assert proc.returncode == 2, out  # pytest's "interrupted"
    # the child's testbeds were named after its pid: none is left, nor any process in them
    assert not [n for n in names_in(NETNS_DIR) + names_in(ETC_NETNS)
                if n.startswith(f"distrun-{proc.pid}-")]
    assert leftovers() == []


def test_the_script_for_humans(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(f"multihost testbed unavailable: {why}")
    label = f"t{os.getpid()}"

    def hosts(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "distrun.testing.hosts", "--label", label,
                               *args], capture_output=True, text=True, timeout=120)

    try:
        up = hosts("up", "2", "--loopback-name", "1")
        assert up.returncode == 0, up.stderr
        assert "host1  eth0 198.18.0.2  link UP  rate none" in up.stdout
        ran = hosts("run", "1", "--", "sh", "-c", "hostname; getent hosts host0 host1")
        assert ran.returncode == 0 and ran.stdout.split() == [
            "host1", "198.18.0.1", "host0", "127.0.1.1", "host1"], ran
        assert hosts("shape", "0", "100mbit").returncode == 0
        assert hosts("cut", "1").returncode == 0
        status = hosts("status").stdout
        assert "host0  eth0 198.18.0.1  link UP  rate 100Mbit" in status
        assert "host1  eth0 198.18.0.2  link DOWN  rate none" in status
        again = hosts("up", "2")
        assert again.returncode == 1 and "is up already" in again.stderr
        assert hosts("run", "5", "--", "true").stderr.strip() == "error: no host 5 (hosts 0..1)"
    finally:
        down = hosts("down")
    assert down.returncode == 0 and down.stdout.strip() == f"testbed '{label}' removed"
    assert not [n for n in names_in(NETNS_DIR) if f"-{label}-" in n]
    gone = hosts("status")
    assert gone.returncode == 1 and "no testbed" in gone.stderr
