"""The plugin API as a third-party plugin uses it: the launcher kit's shapes (``ProcessId``,
``run_key(shared=...)``, a worker group's outputs, the ``Relay``), the run config's methods,
and each name kept for third parties (``THIRD_PARTY`` in ``test_plugin_api.py`` names these).
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from distrun.plugin import (
    NodeRanks,
    ProcessId,
    Relay,
    RunConfig,
    StashKey,
    UsageError,
    WorkerGroup,
    die_with_parent,
    free_port,
    hookimpl,
    hookspec,
    run_key,
)
from distrun.testing import run_cli


def _wait(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _ranks(nproc: int = 1) -> NodeRanks:
    return NodeRanks(nproc=nproc, master_addr="127.0.0.1", master_port=free_port("127.0.0.1"),
                     run_id="kit", bind="127.0.0.1")


# -- ProcessId --------------------------------------------------------------------------------


def test_a_process_id_names_one_process_and_sees_it_end():
    me = ProcessId.of(os.getpid())
    assert me.alive() and me.start
    assert ProcessId.parse(str(me)) == me
    assert not ProcessId(os.getpid(), str(int(me.start) + 1)).alive()  # its pid, another start
    assert ProcessId(os.getpid()).alive()  # start not known: the pid decides
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             preexec_fn=die_with_parent())
    try:
        named = ProcessId.of(child.pid)
        assert named.alive()
    finally:
        child.kill()
        child.wait()
    assert not named.alive() and not ProcessId(child.pid).alive()
    assert ProcessId.of(child.pid).start is None  # gone when named
    assert ProcessId.parse("12.0") == ProcessId.parse("12") == ProcessId(12, "")
    assert ProcessId.parse("pid.1") is None and ProcessId.parse("12.x") is None


LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    status = sys.argv[1]
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[2], status],
                            env={**os.environ, "DISTRUN_LAUNCHER_PID": str(os.getpid())})
    print(rank.pid, flush=True)
    deadline = time.monotonic() + 60
    while "alive" not in open(status).read() and time.monotonic() < deadline:
        time.sleep(0.05)
    # this launcher ends now: its rank is handed to another parent
""")

RANK = textwrap.dedent("""
    import sys, time
    from distrun.plugin import ProcessId
    status, said, deadline = sys.argv[1], "", time.monotonic() + 60
    while time.monotonic() < deadline:
        launcher = ProcessId.launcher()
        now = "alive" if launcher.alive() else "gone"
        if now != said:
            open(status, "a").write(now + "\\n")
            said = now
        if now == "gone":
            break
        time.sleep(0.05)
""")


def test_the_launcher_is_gone_once_its_rank_was_handed_on(tmp_path):
    status = tmp_path / "status"
    status.write_text("")
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(status), RANK],
                                stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent())
    rank = int(launcher.stdout.readline())
    try:
        assert launcher.wait(timeout=60) == 0
        _wait(lambda: "gone" in status.read_text(), "the rank to see its launcher gone")
        assert status.read_text().split() == ["alive", "gone"]
        assert ProcessId.launcher({"DISTRUN_LAUNCHER_PID": str(os.getpid())}) \
            == ProcessId.of(os.getpid())  # another process's launcher, from its environment
        assert ProcessId.launcher({}) is None
    finally:
        launcher.kill()
        launcher.wait()
        if ProcessId(rank).alive():  # (it ends by itself once it saw the launcher gone)
            os.kill(rank, signal.SIGKILL)


# -- run keys and the run config ----------------------------------------------------------


def test_the_nodes_of_a_run_derive_one_key_from_what_they_share():
    key = run_key(shared=("job7", "10.0.0.1:29400"))
    assert key == run_key({"DISTRUN_RUN_KEY": "other"}, shared=("job7", "10.0.0.1:29400"))
    assert key != run_key(shared=("job8", "10.0.0.1:29400"))
    assert run_key({"DISTRUN_RUN_KEY": "given"}) == "given"


def test_a_config_renders_itself_and_asks_its_plugins():
    config = RunConfig().with_values(source="code", max_steps=7)
    assert config.max_steps == 7 and config.sources["max_steps"] == "code"
    lines = config.to_toml().splitlines()
    assert "max_steps = 7  # code" in lines
    assert '# strategy = "auto"  # default' in lines
    assert "[plugins]" not in lines
    # a config built without plugins: no degree asked for, no service offered
    assert config.parallel_degrees() == {} and config.node_services() == []


# -- the worker group's output --------------------------------------------------------------

PRINTS = ("import os, sys; print('to out'); print('to err', file=sys.stderr); "
          "print(os.environ.get('TORCHELASTIC_ERROR_FILE', ''))")


def test_a_worker_group_hands_its_output_to_a_sink_with_log_and_error_files(tmp_path):
    got: list[tuple[str, str]] = []
    group = WorkerGroup([sys.executable, "-c", PRINTS], _ranks(),
                        relay=lambda stream, text: got.append((stream, text)),
                        log_dir=str(tmp_path / "logs"), error_dir=str(tmp_path / "errors"))
    assert group.run() == 0
    out = "".join(text for stream, text in got if stream == "out").splitlines()
    err = "".join(text for stream, text in got if stream == "err").splitlines()
    error_file = str(tmp_path / "errors" / "rank0.error.json")
    assert out == ["to out", error_file] and err == ["to err"]
    assert group.error_file(0) == error_file


def test_a_worker_group_follows_the_runs_output_flags(tmp_path, capsys):
    config = RunConfig().with_values(tee=True, log_dir=str(tmp_path / "logs"))
    group = WorkerGroup([sys.executable, "-c", PRINTS], _ranks(), config=config)
    assert group.run() == 0
    captured = capsys.readouterr()
    assert "[rank0]: to out" in captured.out.splitlines(), captured
    assert "[rank0]: to err" in captured.err.splitlines(), captured
    assert "to err" in (tmp_path / "logs" / "rank0.log").read_text()
    assert group.error_file(0) == str(tmp_path / "logs" / "rank0.error.json")


def test_spares_are_for_distruns_own_worker_only():
    assert WorkerGroup.spares(["./train.sh"], 2) is None
    assert WorkerGroup.spares([sys.executable, "train.py"], 2) is None


# -- names kept for third parties -------------------------------------------------------------


@dataclass
class RemoteRank:
    """A rank that runs elsewhere, as a Ray-like launcher keeps it."""

    rank: int
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))
    log: Any = None


def test_a_relay_prints_remote_ranks_and_names_the_failed_one(capsys):
    relay = Relay(tee=True)
    zero, one = RemoteRank(0), RemoteRank(1)
    relay.emit(zero, "step 1\nstep", sys.stdout)  # a line and a half, as a poll brings them
    relay.emit(one, 'Traceback (most recent call last):\n  File "t.py", line 1\n', sys.stderr)
    relay.emit(one, "ValueError: boom\n", sys.stderr)
    relay.emit(zero, " 2\n", sys.stdout)
    relay.flush(zero, sys.stdout)
    relay.report(one, 1, where="node b")
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["[rank0]: step 1", "[rank0]: step 2"]
    assert captured.err.splitlines() == [
        "[rank1]: Traceback (most recent call last):", '[rank1]:   File "t.py", line 1',
        "[rank1]: ValueError: boom",
        "distrun: rank 1 (node b) failed with exit code 1: ValueError: boom "
        "(its output is above)"]


def test_seed_everything_repeats_every_rngs_draws():
    import numpy as np
    import torch

    from distrun.plugin import seed_everything

    def draws() -> tuple[float, float, float]:
        return random.random(), torch.rand(1).item(), float(np.random.rand())

    seed_everything(3)
    first = draws()
    seed_everything(3)
    assert draws() == first
    seed_everything(4)
    assert all(a != b for a, b in zip(draws(), first))


class CountSpecs:
    """Hooks a third-party plugin adds for other plugins to implement."""

    @hookspec
    def mine_count(self, config: Any) -> int:
        """How many things this plugin counts for ``config``."""


class Counter:
    @hookimpl
    def mine_count(self, config: Any) -> int:
        return config.max_steps


def test_a_plugin_adds_hooks_of_its_own_with_hookspec():
    from distrun._registry.manager import make_plugin_manager

    pm = make_plugin_manager()
    pm.add_hookspecs(CountSpecs)
    pm.register(Counter())
    assert pm.hook.mine_count(config=RunConfig().with_values(max_steps=5)) == [5]


def test_a_strategy_of_its_own_satisfies_the_protocol():
    from distrun.plugin import BaseStrategy, Strategy

    class Mine(BaseStrategy):
        name = "mine"

    assert isinstance(Mine(RunConfig()), Strategy)
    assert not isinstance(object(), Strategy)


MESH = StashKey[str]("kit.mesh")


def test_the_run_offers_a_strategy_its_setup_view():
    import pluggy

    from distrun.plugin import Run, SetupView

    def setup(run: SetupView) -> None:  # what a strategy's setup does with it
        run.stash[MESH] = f"{run.config.max_steps} {run.task} {run.log.name}"

    run = Run(RunConfig().with_values(max_steps=3), "task", pluggy.PluginManager("distrun"))
    setup(run)
    assert run.stash[MESH] == "3 task distrun"


def test_resolve_run_config_resolves_as_distrun_run_does():
    from distrun.plugin import resolve_run_config

    config = resolve_run_config({"max_steps": 3}, 1)
    assert config.max_steps == 3 and config.sources["max_steps"] == "code"
    assert config.pluginmanager is not None  # the plugins' options and hooks come with it
    with pytest.raises(UsageError, match="no_such_option"):
        resolve_run_config({"no_such_option": 1}, 1)
    with pytest.raises(UsageError, match="no_such_strategy"):  # the strategy is chosen too
        resolve_run_config({"strategy": "no_such_strategy"}, 1)


CLUSTER_PLUGIN = '''
from distrun.plugin import ClusterEnv, hookimpl

DISTRUN_PLUGIN_API = 1


@hookimpl
def distrun_detect_cluster(environ):
    if "KIT_RANK" not in environ:
        return None
    rank = int(environ["KIT_RANK"])
    return ClusterEnv("kit-scheduler", nnodes=1, nproc_per_node=2, master_addr="127.0.0.1",
                      master_port=29555, per_process=True, rank=rank, local_rank=rank,
                      world_size=2)
'''

SHOW = "import os; print('RANK', os.environ['RANK'], os.environ['WORLD_SIZE'], " \
       "os.environ['LOCAL_RANK'], os.environ['MASTER_PORT'])\n"


@pytest.mark.slow
def test_a_detected_cluster_runs_its_rank_in_place(tmp_path):
    (tmp_path / "kit_cluster_plugin.py").write_text(CLUSTER_PLUGIN)
    (tmp_path / "show.py").write_text(SHOW)
    result = run_cli("run", "show.py", cwd=tmp_path,
                     env={"PYTHONPATH": str(tmp_path), "DISTRUN_PLUGINS": "kit_cluster_plugin",
                          "KIT_RANK": "1"})
    assert result.returncode == 0, result
    assert "RANK 1 2 1 29555" in result.stdout.splitlines(), result


JOINED = textwrap.dedent("""
    import os, subprocess, sys, time
    rank = '''
    import sys, time
    from distrun.plugin import join_launcher
    join_launcher()
    open(sys.argv[1], "w").write("joined")
    time.sleep(600)
    '''
    subprocess.Popen([sys.executable, "-c", rank, sys.argv[1]],
                     env={**os.environ, "DISTRUN_LAUNCHER_PID": str(os.getpid())})
    time.sleep(600)
""")


@pytest.mark.slow
def test_a_rank_that_joined_its_launcher_dies_with_it(tmp_path):
    joined = tmp_path / "joined"
    launcher = subprocess.Popen([sys.executable, "-c", JOINED, str(joined)],
                                preexec_fn=die_with_parent())
    try:
        _wait(lambda: joined.exists() and joined.read_text() == "joined", "the rank to join")
        (pid,) = _children(launcher.pid)
        rank = ProcessId.of(pid)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    _wait(lambda: not rank.alive(), "the rank to die with its launcher", timeout=30)


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
