"""The memory tier (``--ckpt-memory-every-n-steps``): checkpoints in the node's memory, held by
the launcher, that a restarted worker loads instead of the disk's.

Each run is the recovery tests' run (see conftest): 2 ranks over gloo, a rank SIGKILLed, the
run restarted by ``--max-restarts``, its end compared bit for bit with the uninterrupted run.
"""

from __future__ import annotations

import glob
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from elastic_helpers import TASK, TRAIN, Launcher, final_weights, plugin_env, records

from distrun.testing import free_port, run_cli

MEMORY = "/dev/shm/distrun-ckpt-memory-"


def _assert_same(a: Path, b: Path) -> None:
    got, want = final_weights(a), final_weights(b)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _starts(rec: Path) -> dict[tuple[int, int], dict]:
    return {(e["attempt"], e["rank"]): e for e in records(rec, "events.jsonl")}


def _tiers(pid: int) -> list[str]:
    return glob.glob(f"{MEMORY}{pid}-*")


@pytest.mark.timeout(600)
def test_a_killed_rank_resumes_from_memory_at_the_newest_step(tmp_path, reference):
    """Disk checkpoints every 10 steps, memory every step: rank 1 killed at the end of step 13
    redoes one step, from the memory's step 12 (committed before step 13 was applied), not
    the 3 since the disk's step 10; the run ends bit-equal to the
    uninterrupted run and leaves nothing in /dev/shm. The disk's cadence checkpoints are
    written from the tier's copy, and a run resumed from one ends bit-equal too."""
    rec = tmp_path / "rec"
    result = run_cli("run", "--max-restarts", "1", "--ckpt-every-n-steps", "10",
                     "--ckpt-memory-every-n-steps", "1", *TRAIN, "--name", "mem", TASK,
                     cwd=tmp_path, env=plugin_env(rec, EL_KILL_PLAN="0:13:1"), timeout=540)
    assert result.returncode == 0, result
    assert result.stderr.count("restarting the workers") == 1, result
    assert "memory tier off" not in result.stdout + result.stderr, result
    resumed = _starts(rec)[(1, 0)]
    assert resumed["resumed_from"].startswith(MEMORY), resumed
    assert resumed["step"] == 12, resumed
    assert _starts(rec)[(1, 1)]["step"] == resumed["step"]
    # the disk holds the durable copies only: its cadence's, and the end's
    disk = sorted(p.name for p in (tmp_path / "runs" / "mem" / "checkpoints").glob("step-*"))
    assert disk == ["step-20", "step-30", "step-36"], disk
    _assert_same(rec, reference)
    assert not os.path.exists(os.path.dirname(resumed["resumed_from"]))
    for step in (20, 30):
        assert f"step-{step} (step): written from the memory tier's copy" in result.stdout, \
            result
    again = tmp_path / "again"
    result = run_cli("run", *TRAIN, "--name", "again", "--resume",
                     "runs/mem/checkpoints/step-30", TASK, cwd=tmp_path, env=plugin_env(again),
                     timeout=300)
    assert result.returncode == 0, result
    assert _starts(again)[(0, 0)]["step"] == 30
    _assert_same(again, reference)


@pytest.mark.timeout(600)
def test_a_damaged_memory_copy_falls_back_to_the_disk_and_a_killed_launcher_leaves_none(
        tmp_path, reference):
    """The tier's newest checkpoint damaged (a flipped byte in a data file) while rank 0 waits
    at step 6: after rank 1 is killed, the restart skips it with one line and resumes from the
    disk's step 4, bit-equal in the end. Then the launcher itself is SIGKILLed while the
    tier holds a checkpoint: its folder is gone within seconds."""
    rec = tmp_path / "rec"
    launcher = Launcher(["--max-restarts", "1", "--ckpt-every-n-steps", "2",
                         "--ckpt-memory-every-n-steps", "1", *TRAIN, "--name", "bad", TASK],
                        plugin_env(rec, EL_WAIT_AT="0:6"), tmp_path, "bad")
    try:
        launcher.wait_until(lambda: (rec / "waiting").exists(), "rank 0 waiting at step 6")
        tiers = _tiers(launcher.proc.pid)
        assert len(tiers) == 1, tiers
        newest = Path(tiers[0]) / "step-5"
        latest = Path(tiers[0]) / "latest"  # a file naming the newest committed step
        launcher.wait_until(lambda: latest.exists() and latest.read_text().strip() == "step-5",
                            "step 5 committed in memory")
        # the disk's step 4 is written from the memory's copy in the background
        disk = tmp_path / "runs" / "bad" / "checkpoints" / "latest"
        launcher.wait_until(lambda: disk.exists() and disk.read_text().strip() == "step-4",
                            "step 4 committed on the disk")
        data = sorted(newest.glob("model-*.safetensors"))[0]
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))
        os.kill(_starts(rec)[(0, 1)]["pid"], signal.SIGKILL)
        (rec / "go").touch()
        assert launcher.wait(timeout=480) == 0, launcher.output()
    finally:
        launcher.kill_all()
    out = launcher.output()
    assert out.count(f"skipping {newest}") == 1, out
    resumed = _starts(rec)[(1, 0)]
    assert resumed["resumed_from"] == "runs/bad/checkpoints/step-4", resumed
    _assert_same(rec, reference)
    assert not _tiers(launcher.proc.pid)

    rec2 = tmp_path / "rec2"
    second = Launcher(["--ckpt-memory-every-n-steps", "1", *TRAIN, "--name", "kill", TASK],
                      plugin_env(rec2, EL_WAIT_AT="0:4"), tmp_path, "kill")
    try:
        second.wait_until(lambda: (rec2 / "waiting").exists(), "rank 0 waiting at step 4")
        tiers = _tiers(second.proc.pid)
        assert len(tiers) == 1 and os.listdir(tiers[0]), tiers
        os.kill(second.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while _tiers(second.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _tiers(second.proc.pid)
    finally:
        second.kill_all()


def _two_nodes(tmp_path: Path, rec: Path, name: str, *args: str, **env: str) -> str:
    """Two launchers on this machine, one rank each, rendezvousing as two nodes (each holds
    its own memory tier folder, as on two hosts), run to their end (exit 0): their output."""
    node = [a for a in TRAIN if a not in ("--nproc-per-node", "2")]
    common = ["--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint",
              f"127.0.0.1:{free_port()}", "--rdzv-id", name, *node, *args, "--name", name, TASK]
    nodes = [Launcher(common, plugin_env(rec, **env), tmp_path, f"{name}-node{i}")
             for i in range(2)]
    try:
        for launcher in nodes:
            assert launcher.wait(timeout=480) == 0, launcher.output()
    finally:
        for launcher in nodes:
            launcher.kill_all()
    return "".join(launcher.output() for launcher in nodes)


@pytest.mark.timeout(600)
def test_two_nodes_each_resume_from_their_own_memory(tmp_path, reference):
    """Over two nodes each node's memory holds what its ranks need (a data-parallel state,
    whole on each): rank 1 killed at the end of step 13 restarts both nodes' workers, and each
    rank resumes from its own node's folder at step 12, the newest step both committed; the
    run ends bit-equal to the uninterrupted run and leaves nothing in /dev/shm."""
    rec = tmp_path / "rec"
    out = _two_nodes(tmp_path, rec, "two", "--max-restarts", "1", "--ckpt-every-n-steps", "10",
                     "--ckpt-memory-every-n-steps", "1", EL_KILL_PLAN="0:13:1")
    assert "memory tier off" not in out, out
    # the killed rank's node says why; the other node's agent may see its worker's lost
    # connection or the new round first: both nodes re-form, either way
    assert "rank 1 exited with code 137; restarting the workers" in out, out
    assert out.count("re-formed at 2 ranks on 2 hosts") == 2, out
    first, second = _starts(rec)[(1, 0)], _starts(rec)[(1, 1)]
    assert first["step"] == second["step"] == 12, (first, second)
    folders = {os.path.dirname(first["resumed_from"]), os.path.dirname(second["resumed_from"])}
    assert len(folders) == 2 and all(f.startswith(MEMORY) for f in folders), folders
    _assert_same(rec, reference)
    assert not any(os.path.exists(f) for f in folders)


@pytest.mark.timeout(600)
def test_a_state_sharded_across_nodes_resumes_from_each_nodes_part_and_its_replica(tmp_path):
    """FSDP over two nodes of one rank: each node's memory holds its rank's shards and a copy
    of the other node's. Rank 1 killed at the end of step 13 restarts both nodes' workers, and
    each resumes at step 12 from its node's memory, with the weights the run had at the end
    of step 12 bit for bit; nothing is left in /dev/shm."""
    rec = tmp_path / "rec"
    out = _two_nodes(tmp_path, rec, "split", "--strategy", "fsdp", "--max-restarts", "1",
                     "--ckpt-every-n-steps", "10", "--ckpt-memory-every-n-steps", "1",
                     EL_KILL_PLAN="0:13:1", EL_DIGEST="1",
                     DISTRUN_PLUGINS=plugin_env(rec)["DISTRUN_PLUGINS"] + ",distrun_fsdp.plugin")
    assert "memory tier off" not in out and "skipping" not in out, out
    # each rank's second start (the other node's agent re-forms, or counts a restart too)
    starts = [e for e in records(rec, "events.jsonl") if e["resumed_from"]]
    assert sorted(e["rank"] for e in starts) == [0, 1], starts
    first, second = sorted(starts, key=lambda e: e["rank"])
    assert first["step"] == second["step"] == 12, (first, second)
    assert all(e["resumed_from"].startswith(MEMORY) for e in (first, second)), (first, second)
    before = {d["digest"] for d in records(rec, "digests.jsonl")
              if d["attempt"] == 0 and d["step"] == 12}
    assert before == {first["digest"]} == {second["digest"]}, (before, first, second)
    assert not glob.glob(MEMORY + "*") or all(
        not f.startswith(os.path.dirname(os.path.dirname(e["resumed_from"])))
        for f in glob.glob(MEMORY + "*") for e in (first, second))


def test_a_state_that_does_not_fit_turns_the_tier_off_with_one_line(tmp_path):
    rec = tmp_path / "rec"
    result = run_cli("run", "--ckpt-memory-every-n-steps", "1", "--ckpt-memory-max-gb",
                     "0.000001", *TRAIN, "--max-steps", "6", "--name", "small", TASK,
                     cwd=tmp_path, env=plugin_env(rec), timeout=300)
    assert result.returncode == 0, result
    lines = [ln for ln in result.stdout.splitlines() if "memory tier off" in ln]
    assert len(lines) == 1, result
    assert "--ckpt-memory-max-gb 1e-06 allows" in lines[0] and "disk only" in lines[0], lines
    assert (tmp_path / "runs" / "small" / "checkpoints" / "step-6").is_dir()


def test_the_newest_step_of_memory_or_disk_is_tried_first():
    from distrun_safetensors.load import merge_newest

    disk = ["/d/step-10", "/d/step-8"]
    assert merge_newest(disk, ["/m/step-12", "/m/step-11"]) == [
        "/m/step-12", "/m/step-11", "/d/step-10", "/d/step-8"]
    # the same step: memory first (the faster read); an older one right after the disk's newest
    assert merge_newest(disk, ["/m/step-10", "/m/step-9"]) == [
        "/m/step-10", "/d/step-10", "/m/step-9", "/d/step-8"]
    assert merge_newest(disk, ["/m/step-7"]) == ["/d/step-10", "/m/step-7", "/d/step-8"]
    assert merge_newest([], ["/m/step-3"]) == ["/m/step-3"]
    assert merge_newest(disk, []) == disk


def test_saves_that_take_more_than_five_percent_of_the_time_are_said_once_with_a_cadence():
    """The tier's measure of its saves (what a GPU run meets: a 1 GB state copied and committed
    in ~0.16 s against 33 ms steps): the first two saves left out, ten measured, one verdict
    with the share, its parts and the cadence that keeps them under 5%; cheap saves say
    nothing."""
    from distrun_safetensors.memory_tier import SaveCost

    def measure(copy_s: float, commit_s: float, step_s: float) -> str | None:
        cost, now, said = SaveCost(), 0.0, []
        for step in range(1, 14):  # a save at the end of every step
            said.append(cost.saved(now, step, {"stall_s": copy_s, "waited_s": 0.0}))
            cost.waited(commit_s)  # before the next step's optimizer step
            now += step_s + copy_s + commit_s
        assert all(s is None for s in said[:-1]), said
        return said[-1]

    line = measure(copy_s=0.020, commit_s=0.137, step_s=0.033)
    assert line is not None
    assert line.startswith("its saves take 83% of the training time here (each: 20 ms copying "
                           "this rank's state, 137 ms waiting for a commit; a step takes 33 ms "
                           "without them)"), line
    # 157 ms a save is 5% of 3140 ms: a save every 96 steps of 33 ms
    assert line.endswith("--ckpt-memory-every-n-steps 96 would bring that to about 5%"), line
    assert measure(copy_s=0.0005, commit_s=0.0005, step_s=0.1) is None
