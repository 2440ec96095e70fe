"""The worker group every launcher runs its ranks in, seen from a plugin's node service.

A third-party plugin (``node_service_plugin.py``) offers a service through
``distrun_node_services``; whatever the launcher, it is told of each start of the node's
workers (their ranks and live pids) and of their end (their exit codes), in the launcher's
process. Real ``distrun run`` launches: the local launcher, and the elastic agent's restart.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from distrun.testing import run_cli

HERE = Path(__file__).resolve().parent
ENVDUMP = HERE.parent / "plugins" / "elastic" / "envdump.py"


def _env(tmp_path: Path, plugins: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "DISTRUN_DISABLE_PLUGIN_AUTOLOAD": "1", "DISTRUN_PLUGINS": plugins,
            "NODE_SERVICE_LOG": str(tmp_path / "service.jsonl")}


def _events(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "service.jsonl").read_text().splitlines()]


def test_a_node_service_sees_the_local_launchers_ranks_start_and_end(tmp_path):
    result = run_cli("run", "--nproc-per-node", "2", str(ENVDUMP), cwd=tmp_path,
                     env=_env(tmp_path, "node_service_plugin"))
    assert result.returncode == 0, result
    started, ended = _events(tmp_path)
    assert started["event"] == "started" and started["ranks"] == [0, 1], started
    assert started["world"] == 2 and len(set(started["pids"])) == 2, started
    # (whether each pid is still alive when the service hears of it depends on how soon a
    # short script ends: not asserted)
    assert ended == {"launcher": started["launcher"], "event": "ended", "ranks": [0, 1],
                     "codes": [0, 0]}, ended


@pytest.mark.slow
def test_a_node_service_sees_each_attempt_of_an_elastic_restart(tmp_path):
    result = run_cli("run", "--max-restarts", "1", "--nproc-per-node", "2", str(ENVDUMP),
                     cwd=tmp_path, env={**_env(tmp_path, "node_service_plugin,distrun_elastic.plugin"),
                                        "FAIL_FIRST": "1"})
    assert result.returncode == 0, result
    events = _events(tmp_path)
    assert [e["event"] for e in events] == ["started", "ended", "started", "ended"], events
    first, failed, second, done = events
    assert failed["codes"][1] == 3, failed  # rank 1 failed on purpose; rank 0 was stopped
    assert done["codes"] == [0, 0], done
    assert set(first["pids"]).isdisjoint(second["pids"]), events  # new processes
    assert first["launcher"] == second["launcher"], events  # one agent, told of both


def test_a_process_that_began_to_exit_shows_its_code_before_it_can_be_reaped():
    # what a launcher reads of a worker that has begun to exit (exiting_code): the kernel frees
    # a big process's memory before the exit can be reaped, and the code is there from the
    # start. Never reaped here before the reads, so each read is of the dying or dead process.
    import signal
    import subprocess
    import sys
    import time

    from distrun._launch.exits import exiting_code

    def child(code: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code])

    killed = child("import time; b = bytearray(200 << 20); time.sleep(60)")
    exits_3 = child("import os; os._exit(3)")
    clean = child("pass")
    requeue = child("import os; os._exit(143)")
    running = child("import time; time.sleep(60)")
    try:
        time.sleep(0.5)
        killed.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while exiting_code(exits_3.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        while exiting_code(killed.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert exiting_code(killed.pid) == -9
        assert exiting_code(exits_3.pid) == 3
        time.sleep(0.5)  # the agreed exits are done by now: their codes are left to the reap
        assert exiting_code(clean.pid) is None
        assert exiting_code(requeue.pid) is None  # a saved stop the ranks agreed on
        assert exiting_code(running.pid) is None
        # and the reap agrees
        assert killed.wait() == -9 and exits_3.wait() == 3 and clean.wait() == 0
        assert requeue.wait() == 143
    finally:
        for p in (killed, exits_3, clean, requeue, running):
            p.kill()
            p.wait()


def test_a_process_has_begun_to_exit_only_once_every_thread_has():
    # has_begun_exit: what a stop that does not wait for the reap waits for. A main thread
    # that ends by itself (pthread_exit) leaves the process running on its other thread.
    import subprocess
    import sys
    import time

    from distrun._launch.exits import has_begun_exit

    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = subprocess.Popen([sys.executable, "-c", "import os; os._exit(0)"])
    lone_thread = subprocess.Popen([sys.executable, "-c", (
        "import ctypes, threading, time\n"
        "threading.Thread(target=time.sleep, args=(4,)).start()\n"
        "time.sleep(0.3)\n"
        "ctypes.CDLL(None).pthread_exit(None)\n")])
    try:
        deadline = time.monotonic() + 30
        while not has_begun_exit(exited.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert has_begun_exit(exited.pid)  # never reaped yet: a zombie
        time.sleep(1.0)  # the main thread has ended by now, the other sleeps on
        with open(f"/proc/{lone_thread.pid}/stat") as fh:
            assert fh.read().rpartition(")")[2].split()[0] == "Z"  # what /proc shows of it
        assert not has_begun_exit(lone_thread.pid)
        assert not has_begun_exit(running.pid)
        assert lone_thread.wait(timeout=30) == 0 and exited.wait() == 0
    finally:
        for p in (running, exited, lone_thread):
            p.kill()
            p.wait()


def test_a_process_that_holds_a_device_file_open_is_seen_to():
    import subprocess
    import sys

    from distrun._launch.exits import holds_device

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            stdin=subprocess.DEVNULL)
    try:
        assert holds_device(proc.pid, ("/dev/null",))  # its stdin
        assert not holds_device(proc.pid)  # no GPU here: none of the devices' files
    finally:
        proc.kill()
        proc.wait()


_STOPPING = """
import os, signal, sys, time
def stop(signum, frame):
    print(f"rank {os.environ['RANK']} stops", flush=True)
    print(f"rank {os.environ['RANK']} says why", file=sys.stderr, flush=True)
    big = bytearray(300 << 20)  # (pages to free: an exit the kernel takes a while to end)
    for i in range(0, len(big), 4096):
        big[i] = 1
    os._exit(1)
signal.signal(signal.SIGTERM, stop)
print(f"rank {os.environ['RANK']} started", flush=True)
time.sleep(600)  # (until the test stops it)
"""


def test_a_stop_that_does_not_reap_returns_once_every_worker_began_to_exit(tmp_path, capfd):
    # What the elastic agent's restart uses: the new workers need not wait for the kernel to
    # free the old ones' memory. All they wrote is out before the stop returns, the services
    # are told then, and the reap (logs closed, records removed) follows in the background.
    import sys
    import time

    from distrun._launch.exits import has_begun_exit
    from distrun._launch.ports import free_port
    from distrun._launch.ranks import NodeRanks
    from distrun.plugin import WorkerGroup

    script = tmp_path / "stopping.py"
    script.write_text(_STOPPING)
    told: list[tuple[str, list]] = []

    class Service:
        def started(self, group):
            told.append(("started", group.poll()))

        def ended(self, group):
            told.append(("ended", [has_begun_exit(w.proc.pid) for w in group.workers]))

    ranks = NodeRanks(nproc=2, master_addr="127.0.0.1", master_port=free_port("127.0.0.1"),
                      run_id="stop-test")
    group = WorkerGroup([sys.executable, str(script)], ranks, log_dir=str(tmp_path / "logs"),
                        services=[Service()]).start()
    positions = group.positions
    try:
        deadline, said = time.monotonic() + 60, ""
        while said.count("started") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # (both handlers installed)
            said += capfd.readouterr().out
        assert said.count("started") == 2, said
        group.stop(grace=30.0, reap=False)
        print("after the stop", flush=True)
        assert all(has_begun_exit(w.proc.pid) for w in group.workers)
        assert told == [("started", [None, None]), ("ended", [True, True])], told
        group.finish(timeout=60)
        assert [w.proc.returncode for w in group.workers] == [1, 1]
        assert positions is not None and not os.path.exists(positions)
        assert all(w.log is None and not w.threads for w in group.workers)
        out, err = capfd.readouterr()
        assert out.index("rank 0 stops") < out.index("after the stop"), out
        assert out.index("rank 1 stops") < out.index("after the stop"), out
        assert "rank 0 says why" in err and "rank 1 says why" in err, err
        logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
        assert "rank 1 stops" in (tmp_path / "logs" / logs[1]).read_text(), logs
    finally:
        group.close()
