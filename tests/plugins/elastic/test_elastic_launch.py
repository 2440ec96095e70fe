"""The launch side: options, the plan handed to torch's agent, and torchrun's environment."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from elastic_helpers import plugin_env

from distrun._config.run_config import resolve_config
from distrun._registry.collect import collect_options
from distrun._registry.manager import make_plugin_manager
from distrun.plugin import UsageError
from distrun.testing import run_cli
from distrun.testing.sockets import HOLD_SCRIPT, listeners_of_held_run

HERE = Path(__file__).resolve().parent
ENV = {"DISTRUN_DISABLE_PLUGIN_AUTOLOAD": "1", "DISTRUN_PLUGINS": "distrun_elastic.plugin"}


def config_of(**flags):
    from distrun_elastic.settings import make_plan  # noqa: F401 - torch-free import check

    pm = make_plugin_manager(autoload=False, extra=["distrun_elastic.plugin"])
    config = resolve_config(collect_options(pm), flags={k: str(v) for k, v in flags.items()})
    # What the core's launcher fills in before distrun_launch: a default name and folder.
    name = config.name or "train-20260101-120000"
    return config.with_values(name=name, run_dir=config.run_dir or os.path.join("runs", name))


def test_answers_only_when_elasticity_is_asked_for():
    from distrun_elastic.settings import wants_elastic

    assert not wants_elastic(config_of())
    assert not wants_elastic(config_of(nnodes="2"))
    assert wants_elastic(config_of(max_restarts=1))
    assert wants_elastic(config_of(nnodes="1:2"))
    assert wants_elastic(config_of(rdzv_endpoint="10.0.0.1:29400"))


def test_single_node_plan_binds_loopback_and_resumes_automatically():
    from distrun_elastic.settings import make_plan

    environ: dict[str, str] = {}
    plan, config = make_plan(config_of(max_restarts=2, nproc_per_node=2), environ)
    assert (plan.min_nodes, plan.max_nodes, plan.nproc_per_node) == (1, 1, 2)
    assert plan.rdzv_backend == "c10d" and plan.rdzv_endpoint == "127.0.0.1:0"
    assert plan.local_addr == "127.0.0.1"
    # the config every attempt's workers take (the worker group hands it to them)
    assert json.loads(plan.config.to_json())["values"]["resume"] == "auto"
    assert config.resume == "auto"


def test_an_explicit_resume_choice_is_kept():
    from distrun_elastic.settings import make_plan

    plan, _ = make_plan(config_of(max_restarts=1, resume="never"), {})
    assert json.loads(plan.config.to_json())["values"]["resume"] == "never"


def test_rdzv_id_names_the_run_so_nodes_share_checkpoints():
    from distrun_elastic.settings import make_plan

    environ: dict[str, str] = {}
    plan, config = make_plan(config_of(nnodes="1:4", rdzv_endpoint="127.0.0.2:29400",
                                       rdzv_id="job7", rdzv_conf="last_call_timeout=5"), environ)
    assert plan.run_id == "job7" and config.name == "job7"
    assert config.run_dir == os.path.join("runs", "job7")
    # this node's address toward the rendezvous host (never its host name, which may resolve
    # to the loopback), where its servers listen too: all nodes on this machine here
    assert plan.local_addr == plan.bind_address == "127.0.0.2"
    # the nodes of one run share one key for their folder locks
    from distrun.plugin import run_key

    assert plan.run_key == run_key(shared=("job7", "127.0.0.2:29400"))
    assert plan.rdzv_configs == {"last_call_timeout": "5"}
    # A name the user chose wins over the rendezvous id.
    _, named = make_plan(config_of(nnodes="1:4", rdzv_endpoint="127.0.0.1:1", rdzv_id="job7",
                                   name="mine"), {})
    assert named.name == "mine"


@pytest.mark.parametrize("flags, message", [
    ({"nnodes": "1:2"}, "needs --rdzv-endpoint HOST:PORT"),
    ({"nnodes": "1:2", "rdzv_endpoint": "h:1"}, "needs --rdzv-id ID"),
    ({"max_restarts": 1, "rdzv_conf": "oops"}, "is not KEY=VALUE"),
    ({"nnodes": "1:2", "rdzv_backend": "static"}, "needs a dynamic rendezvous"),
])
def test_plan_errors_say_how_to_fix(flags, message):
    from distrun_elastic.settings import make_plan

    with pytest.raises(UsageError, match=message):
        make_plan(config_of(**flags), {})


def test_help_lists_the_options_and_a_range_without_endpoint_is_a_usage_error(cli, tmp_path):
    help_text = cli("run", "--help", env=ENV).stdout
    for flag in ("--max-restarts", "--max_restarts", "--rdzv-endpoint", "--rdzv_endpoint",
                 "--rdzv-backend", "--rdzv-id", "--rdzv-conf", "--monitor-interval"):
        assert flag in help_text
    result = cli("run", "--nnodes", "1:2", str(HERE / "envdump.py"), cwd=tmp_path, env=ENV)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --nnodes 1:2 needs --rdzv-endpoint HOST:PORT: the address every node can reach "
        "(the node at HOST hosts the rendezvous)"]


def test_torchrun_script_gets_torchruns_environment_and_is_restarted(tmp_path):
    # torchrun's spellings, a plain script, rank 1 fails once: one restart, then success.
    result = run_cli("run", "--max_restarts", "1", "--nproc_per_node", "2", "--tee",
                     "--monitor_interval", "0.05", str(HERE / "envdump.py"), cwd=tmp_path,
                     env={**ENV, "FAIL_FIRST": "1"})
    assert result.returncode == 0, result
    assert "distrun: rank 1 exited with code 3; restarting the workers" in result.stderr
    assert "[rank1]: first attempt fails on purpose" in result.stderr
    envs = [json.loads(line.split("ENV ", 1)[1]) for line in result.stdout.splitlines()
            if "ENV " in line]
    last = [e for e in envs if e["TORCHELASTIC_RESTART_COUNT"] == "1"]
    assert sorted(e["RANK"] for e in last) == ["0", "1"]
    first = [e for e in envs if e["TORCHELASTIC_RESTART_COUNT"] == "0"]
    assert {e["MASTER_PORT"] for e in first}.isdisjoint({e["MASTER_PORT"] for e in last})
    for env in envs:
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["OMP_NUM_THREADS"] == "1"
        # one node: the agent serves each attempt a new store (not the shared rendezvous store
        # of pytorch#167288), so every worker is a client of a store already listening
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert json.loads(env["DISTRUN_CONFIG"])["values"]["resume"] == "auto"
    for line in result.stdout.splitlines():
        assert line.startswith(("[rank0]: ", "[rank1]: "))
    # Each attempt's rendezvous picks its own store port.
    ports = {e["TORCHELASTIC_RESTART_COUNT"]: e["MASTER_PORT"] for e in envs}
    assert ports["0"] != ports["1"]
    # ... and is a new round: its generation (run.generation) is one more, on every rank
    rounds = {(e["TORCHELASTIC_RESTART_COUNT"], e["DISTRUN_RDZV_GENERATION"]) for e in envs}
    assert rounds == {("0", "1"), ("1", "2")}, envs


#: the first attempt fails; the restarted one holds while the test lists the sockets
RESTART_THEN_HOLD = """
import os, sys
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    sys.exit(3)
""" + HOLD_SCRIPT


@pytest.mark.slow
def test_the_agents_stores_and_the_workers_listen_on_loopback_only(tmp_path):
    """The rendezvous store, the restarted attempt's store and gloo: none on every interface."""
    (tmp_path / "hold.py").write_text(RESTART_THEN_HOLD)
    hold = tmp_path / "hold"
    hold.mkdir()
    listeners, code, output = listeners_of_held_run(
        [sys.executable, "-m", "distrun", "run", "--max-restarts", "1", "--nproc-per-node", "2",
         "--monitor-interval", "0.05", "hold.py", str(hold)], hold, 2, cwd=tmp_path, env=ENV)
    assert code == 0, output
    assert "rank 1 exited with code 3; restarting the workers" in output
    agent = [s for s in listeners if "distrun._worker.main" not in s.command]
    assert len(agent) >= 2, "\n".join(map(str, listeners))  # rendezvous + attempt store
    assert all(s.loopback for s in listeners), "\n".join(map(str, listeners))


@pytest.mark.slow
def test_a_failing_rank_is_reported_once_with_its_last_lines(tmp_path):
    # Rank 1 fails in both attempts; rank 0 is stopped by the agent and is not reported.
    result = run_cli("run", "--max-restarts", "1", "--nproc-per-node", "2",
                     str(HERE / "envdump.py"), cwd=tmp_path, env={**ENV, "FAIL_ALWAYS": "1"})
    assert result.returncode == 3, result
    err = result.stderr
    assert err.count("distrun: rank 1 exited with code 3; restarting") == 1, result
    # Its lines were shown as they came; the report is one line naming the rank.
    assert len(re.findall(r"^distrun: rank 1 failed with exit code 3: .* \(its output is "
                          r"above\)$", err, re.M)) == 1, result
    assert "rank 0" not in err
    assert err.count("attempt 1: step 3 went wrong") == 1, result


@pytest.mark.slow
def test_a_restart_stops_the_survivors_mid_step_and_names_the_rank_that_failed(tmp_path):
    # The agent tells rank 0 that rank 1 failed before it stops it: rank 0 ends its step at
    # once (not after the grace, killed with no word), and the restarted attempt trains on.
    task = HERE.parents[1] / "core" / "midstep_task.py"
    result = run_cli("run", "--max-restarts", "1", "--nproc-per-node", "2", "--batch-size", "8",
                     "--strategy", "gradsum", "--max-steps", "6", "--no-summary",
                     f"{task}:MidStep", cwd=tmp_path, env=plugin_env(tmp_path / "rec"),
                     timeout=180)
    assert result.returncode == 0, result
    err = result.stderr.splitlines()
    assert "error: rank 0: stopped at step 2 because rank 1 failed with exit code 137 " \
        "(killed by SIGKILL)" in err, result.stderr
    assert sum("rank 1 exited with code 137" in line and "restarting the workers" in line
               for line in err) == 1, result.stderr
    assert not (tmp_path / "rank0-finished-its-step").exists()


@pytest.mark.parametrize("code, said", [(143, "exit 143 (requeue)"), (2, "")])
@pytest.mark.slow
def test_requeue_and_usage_error_exits_are_not_restarted(tmp_path, code, said):
    # 143: the workers saved a preemption checkpoint; 2: a usage error. Neither is retried.
    result = run_cli("run", "--max-restarts", "3", "--nproc-per-node", "2",
                     str(HERE / "envdump.py"), cwd=tmp_path,
                     env={**ENV, "FAIL_ALWAYS": "1", "FAIL_CODE": str(code)})
    assert result.returncode == code, result
    assert "restarting" not in result.stderr
    assert said in result.stderr
    assert result.stdout.count("ENV ") == 2  # one attempt only


def test_rendezvous_timings_follow_the_heartbeat_timeout_and_rdzv_conf_wins():
    """torch's keep-alive expiry fits inside the heartbeat timeout (a lost host is out of the
    rendezvous when distrun names it), its last call and store reads are short; every key the
    user gives in --rdzv-conf is kept as given."""
    from distrun_elastic.launch import rendezvous_defaults
    from distrun_elastic.settings import make_plan

    plan, _ = make_plan(config_of(nnodes="1:2", rdzv_endpoint="10.0.0.1:29400", rdzv_id="j",
                                  heartbeat_timeout=9), {})
    derived = rendezvous_defaults(plan)
    assert derived["keep_alive_interval"] * derived["keep_alive_max_attempt"] <= 9
    assert derived["last_call_timeout"] < 30 and derived["read_timeout"] < 60
    given = "last_call_timeout=11,keep_alive_interval=7,join_timeout=5,close_timeout=6"
    plan, _ = make_plan(config_of(nnodes="1:2", rdzv_endpoint="10.0.0.1:29400", rdzv_id="j",
                                  rdzv_conf=given), {})
    assert {**rendezvous_defaults(plan), **plan.rdzv_configs}["last_call_timeout"] == "11"
    assert plan.rdzv_configs == {"last_call_timeout": "11", "keep_alive_interval": "7",
                                 "join_timeout": "5", "close_timeout": "6"}


def test_a_rendezvous_that_never_completes_ends_at_join_timeout_in_one_line(tmp_path):
    """--rdzv-conf join_timeout reaches torch's rendezvous: alone where 2 nodes are needed,
    the node gives up after 3 s (not torch's 600) and says what to do."""
    from distrun.testing import free_port

    port = free_port()
    (tmp_path / "never.py").write_text("raise SystemExit('a worker started')\n")
    result = run_cli("run", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                     "--rdzv-id", "alone", "--rdzv-conf", "join_timeout=3", "never.py",
                     cwd=tmp_path, env=ENV, timeout=120)
    assert result.returncode == 1, result
    assert result.stderr.splitlines()[-1] == (
        f"error: rendezvous 'alone' at 127.0.0.1:{port}: fewer than 2 nodes joined within "
        "join_timeout=3 s (start the other nodes with the same --rdzv-endpoint and --rdzv-id, "
        "or give more time: --rdzv-conf join_timeout=SECONDS)")


@pytest.mark.parametrize(("flags", "line"), [
    (["--rdzv-conf", "join_timeout=abc"],
     "error: invalid value for --rdzv-conf: join_timeout='abc' (use a whole number of seconds "
     "above 0, e.g. join_timeout=60)"),
    (["--rdzv-conf", "join_timeout=-5"],
     "error: invalid value for --rdzv-conf: join_timeout='-5' (use a whole number of seconds "
     "above 0, e.g. join_timeout=60)"),
    (["--rdzv-conf", "last_call_timeout="],
     "error: invalid value for --rdzv-conf: last_call_timeout='' (use a whole number of "
     "seconds above 0, e.g. last_call_timeout=60)"),
    (["--rdzv-conf", "is_host=maybe"],
     "error: invalid value for --rdzv-conf: is_host='maybe' (use one of 1, true, t, yes, y, 0, "
     "false, f, no, n, e.g. is_host=true)"),
    (["--rdzv-conf", "store_type=redis"],
     "error: invalid value for --rdzv-conf: store_type='redis' (use one of tcp, file, e.g. "
     "store_type=tcp)"),
    (["--rdzv-conf", "a=b"],
     "error: invalid value for --rdzv-conf: unknown key 'a' for the c10d rendezvous (known: "
     "close_timeout, heartbeat_timeout, is_host, join_timeout, keep_alive_interval, "
     "keep_alive_max_attempt, last_call_timeout, read_timeout, store_type, timeout)"),
    (["--rdzv-backend", "static", "--rdzv-conf", "join_timeout=5"],
     "error: invalid value for --rdzv-conf: unknown key 'join_timeout' for the static "
     "rendezvous (known: is_host, rank, timeout)"),
    (["--nnodes", "3:2", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "j"],
     "error: invalid value for --nnodes: '3:2' (use N or MIN:MAX with MIN at most MAX, e.g. 2 "
     "or 1:2)"),
])
def test_a_bad_rendezvous_setting_is_one_usage_line_before_anything_starts(cli, tmp_path,
                                                                           flags, line):
    """Each key and value is checked where it is parsed (not blamed on the endpoint after
    torch's handler refused it): exit 2, naming the key and what it takes."""
    result = cli("run", "--max-restarts", "1", *flags, str(HERE / "envdump.py"), cwd=tmp_path,
                 env=ENV)
    assert result.returncode == 2, result
    assert result.stderr.splitlines() == [line], result

