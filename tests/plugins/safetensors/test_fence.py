"""Fencing: a commit is a compare-and-swap on the folder's generation, between real processes.

A start of a run (an elastic rendezvous round, a `distrun run`) draws a generation from the
checkpoint folder at its first save; ``latest`` moves only for the newest one. See fence.py.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import re
import threading
import time

import pytest
from st_layouts import build, train_step

from distrun_safetensors.errors import CheckpointError, FencedError
from distrun_safetensors.fence import CommitLock, LockLost, clear_dead_lock
from distrun_safetensors.load import load
from distrun_safetensors.manifest import read_latest, read_manifest
from distrun_safetensors.save import Checkpointer
from distrun_safetensors.validation import validate

STALE = re.compile(r"fenced: round (\d+) has (committed step \d+|started since \(latest: step "
                   r"\d+\)); this node's round (\d+) is stale \(the run re-formed without it, "
                   r"or a newer run writes .*\); its checkpoint of step (\d+) was not committed")


def _save(saver: Checkpointer, step: int) -> None:
    model, opt = build("plain", seed=step)
    train_step(model, opt, step)
    saver.save(step, model, opt, {"progress": {"step": step}})


def _latest(directory: str) -> tuple[str, int] | None:
    folder, _ = read_latest(directory)
    if folder is None:
        return None
    try:
        manifest = read_manifest(folder)
    except CheckpointError:  # pruned between the two reads
        return None
    return os.path.basename(folder), manifest.get("generation", 0)


def _writer(directory: str, rdzv: int, first: int, out: str, go: object, started: object,
            finished: object, until: object | None, saves: int) -> None:
    """Save steps first, first + 1, ... as fast as it can, recording each outcome: ``saves``
    of them, or (``until``) until that event is set and one more after it. A writer still at
    it after 90 s writes its stack to ``out.stack``; one that fails writes why to ``out.err``
    (the test's failure message shows both)."""
    import faulthandler
    import traceback

    stack = open(out + ".stack", "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.dump_traceback_later(90, file=stack)
    try:
        saver = Checkpointer(directory, keep_last=0, rdzv_generation=rdzv)
        go.wait(60)
        outcomes = []
        step, last = first, False
        while True:
            try:
                _save(saver, step)
                outcomes.append([step, "ok", saver.generation])
            except FencedError as exc:
                outcomes.append([step, str(exc), saver.generation])
            started.set()
            step += 1
            if last or (until is None and len(outcomes) == saves):
                break
            last = until is not None and until.is_set()
        with open(out, "w") as fh:
            json.dump(outcomes, fh)
    except BaseException:
        with open(out + ".err", "w") as fh:
            fh.write(traceback.format_exc())
        os._exit(1)
    finished.set()
    os._exit(0)


def _writers_said(*outs: str) -> str:
    """What the writers left about a failure or a hang (see _writer)."""
    said = []
    for out in outs:
        for suffix in (".err", ".stack"):
            with contextlib.suppress(OSError), open(out + suffix) as fh:
                text = fh.read().strip()
                if text:
                    said.append(f"{os.path.basename(out)}{suffix}:\n{text}")
    return "\n".join(said)


def test_two_processes_race_and_a_stale_generation_never_moves_latest(tmp_path):
    """Round 3 (stale) keeps committing while round 4 starts and commits: from round 4's first
    draw on, every commit of round 3 is refused and leaves nothing, every commit of round 4
    goes through, and `latest` never goes back to round 3 (watched throughout)."""
    directory = str(tmp_path / "ckpt")
    ctx = mp.get_context("fork")
    go_old, go_new, old_started, new_started = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    old_done, new_done = ctx.Event(), ctx.Event()
    old = ctx.Process(target=_writer, args=(directory, 3, 1, str(tmp_path / "old.json"), go_old,
                                            old_started, old_done, new_done, 0))
    new = ctx.Process(target=_writer, args=(directory, 4, 10001, str(tmp_path / "new.json"),
                                            go_new, new_started, new_done, None, 15))
    old.start()
    new.start()
    seen: list[tuple[str, int]] = []
    try:
        go_old.set()
        assert old_started.wait(120)
        go_new.set()  # round 4 starts while round 3 is in the middle of its saves
        while not (old_done.is_set() and new_done.is_set()):
            now = _latest(directory)
            if now is not None and (not seen or seen[-1] != now):
                seen.append(now)
            if not (old.is_alive() and new.is_alive()) and not (old_done.is_set()
                                                                and new_done.is_set()):
                break  # one died: the exit codes below say so
            time.sleep(0.005)
    finally:
        for proc in (old, new):
            proc.join(120)
            if proc.is_alive():
                proc.kill()
    assert old.exitcode == 0 and new.exitcode == 0, (
        f"exit codes {old.exitcode}, {new.exitcode}\n"
        + _writers_said(str(tmp_path / "old.json"), str(tmp_path / "new.json")))
    olds = json.loads((tmp_path / "old.json").read_text())
    news = json.loads((tmp_path / "new.json").read_text())
    assert [o[1] for o in news] == ["ok"] * 15  # the fresh one always commits
    assert {o[2] for o in olds} == {3} and {o[2] for o in news} == {4}
    assert olds[0][1] == "ok"
    fenced = [o for o in olds if o[1] != "ok"]
    assert fenced, olds  # its last save began after round 4 finished
    first = olds.index(fenced[0])
    assert all(o[1] != "ok" for o in olds[first:]), olds  # once fenced, always fenced
    for step, message, _ in fenced:
        m = STALE.fullmatch(message)
        assert m and (m[1], m[3], m[4]) == ("4", "3", str(step)), message
        assert not os.path.exists(os.path.join(directory, f"step-{step}"))
    assert not [n for n in os.listdir(directory) if n.startswith(".tmp-")]  # nothing left
    gens = [g for _, g in seen]
    assert 4 in gens and gens == sorted(gens), seen  # latest never went back to round 3
    assert _latest(directory) == ("step-10015", 4)


def test_a_stale_commit_after_a_fresh_one_is_refused_with_one_line(tmp_path, cli):
    directory = str(tmp_path / "ckpt")
    stale = Checkpointer(directory, rdzv_generation=1)
    _save(stale, 10)
    fresh = Checkpointer(directory, rdzv_generation=2)  # the survivors, from step 6
    _save(fresh, 6)
    with pytest.raises(FencedError) as info:
        _save(stale, 12)
    assert str(info.value) == (
        f"fenced: round 2 has committed step 6; this node's round 1 is stale (the run re-formed "
        f"without it, or a newer run writes {directory}); its checkpoint of step 12 was not "
        "committed")
    assert "\n" not in str(info.value) and info.value.exit_code == 1
    assert sorted(os.listdir(directory)) == [".generation", "latest", "step-10", "step-6"]
    assert _latest(directory) == ("step-6", 2)
    # its next attempt too, and a save of a step the survivors hold leaves theirs alone
    with pytest.raises(FencedError, match="this node's round 1 is stale"):
        _save(stale, 6)
    assert read_manifest(os.path.join(directory, "step-6"))["generation"] == 2
    _save(fresh, 8)  # the survivors go on
    assert _latest(directory) == ("step-8", 2)
    listing = cli("ckpt", "ls", directory).stdout.splitlines()
    assert [(ln[2:].split()[0], ln.split()[-1]) for ln in listing] == [
        ("step-8", "2"), ("step-6", "2"), ("step-10", "1")], listing  # newest round first
    assert "round 2 (rendezvous round 2)" in cli("ckpt", "inspect", directory).stdout


def test_a_relaunched_job_counting_rounds_from_1_again_still_commits(tmp_path):
    """The rendezvous store lives in one agent: a job launched again counts its rounds from 1.
    The folder's counter goes on from the newest generation drawn, so the relaunch commits and
    what is left of the old job is fenced; a run outside the elastic agent (round 0) too."""
    directory = str(tmp_path / "ckpt")
    before = Checkpointer(directory, rdzv_generation=5)
    _save(before, 4)
    relaunch = Checkpointer(directory, rdzv_generation=1)
    _save(relaunch, 6)
    assert relaunch.generation == 6
    manifest = read_manifest(os.path.join(directory, "step-6"))
    assert (manifest["generation"], manifest["rdzv_generation"]) == (6, 1)
    with pytest.raises(FencedError, match="round 6 has committed step 6; this node's round 5"):
        _save(before, 8)
    plain = Checkpointer(directory)  # `distrun run --resume auto` without the elastic agent
    _save(plain, 7)
    assert plain.generation == 7 and _latest(directory) == ("step-7", 7)


def test_the_groups_of_one_launchers_round_share_its_generation(tmp_path, monkeypatch):
    """`distrun run --ft`: replica groups of one launcher (one round) each start saving when
    they are the lowest live replica, after the others restarted. They join the round's
    generation, so a group that trained on alone is not fenced by its restarted peer; a start
    of another launcher (or round) draws a newer one and fences them as before."""
    from distrun._launch.folder_lock import RUN_KEY_ENV
    from distrun._launch.lifeline import LAUNCHER_PID_ENV

    directory = str(tmp_path / "ckpt")
    monkeypatch.setenv(LAUNCHER_PID_ENV, str(os.getppid()))  # a live launcher: our parent
    monkeypatch.setenv(RUN_KEY_ENV, "run-a")
    group1 = Checkpointer(directory)
    _save(group1, 5)  # group 0 died: group 1 saves alone
    group0 = Checkpointer(directory)  # group 0's replacement, healed, saves again
    _save(group0, 10)
    assert group0.generation == group1.generation == 1
    _save(group1, 15)  # group 0 died again: group 1 alone, not stale
    _save(group0, 20)
    assert _latest(directory) == ("step-20", 1)
    # a writer of the round that froze while the round went on never moves latest back
    with pytest.raises(FencedError) as info:
        _save(group1, 17)
    assert str(info.value) == (
        f"fenced: step 20 of this round is committed in {directory}; this writer's checkpoint "
        "of step 17 is older (it was frozen or cut off while the run went on) and was not "
        "committed")
    assert _latest(directory) == ("step-20", 1)
    next_round = Checkpointer(directory, rdzv_generation=1)  # another round of this launcher
    _save(next_round, 25)
    assert next_round.generation == 2
    with pytest.raises(FencedError, match="round 2 has committed step 25; this node's round 1"):
        _save(group1, 30)
    monkeypatch.setenv(RUN_KEY_ENV, "run-b")  # another launch on the same folder
    other = Checkpointer(directory, rdzv_generation=1)
    _save(other, 30)
    assert other.generation == 3
    with pytest.raises(FencedError, match="this node's round 2 is stale"):
        _save(next_round, 35)
    monkeypatch.delenv(LAUNCHER_PID_ENV)  # no launcher: every start draws
    first, second = Checkpointer(directory), Checkpointer(directory)
    _save(first, 40)
    _save(second, 45)
    assert (first.generation, second.generation) == (4, 5)
    with pytest.raises(FencedError, match="this node's round 4 is stale"):
        _save(first, 50)


def test_resume_prefers_the_newest_generation_then_the_newest_step(tmp_path, caplog):
    """Round 1 reached step 20; round 2 re-formed from step 10 and saved step 15. Even with
    `latest` moved back to round 1's step 20 (what a writer frozen past the lock's stale age
    could still do), a resume takes round 2's newest step."""
    directory = str(tmp_path / "ckpt")
    one = Checkpointer(directory, rdzv_generation=1)
    for step in (10, 20):
        _save(one, step)
    two = Checkpointer(directory, rdzv_generation=2)
    for step in (12, 15):
        _save(two, step)
    fresh, fresh_opt = build("plain", seed=99)
    assert load("latest", fresh, fresh_opt, ckpt_dir=directory).step == 15
    (tmp_path / "ckpt" / "latest").write_text("step-20\n")
    fresh, fresh_opt = build("plain", seed=99)
    result = load("auto", fresh, fresh_opt, ckpt_dir=directory)
    assert result.step == 15 and result.path.endswith("step-15")
    # within a generation `latest` still comes first (a step saved again, e.g.)
    (tmp_path / "ckpt" / "latest").write_text("step-12\n")
    fresh, fresh_opt = build("plain", seed=99)
    assert load("auto", fresh, fresh_opt, ckpt_dir=directory).step == 12


def test_the_manifest_records_the_round_and_a_malformed_one_is_refused(tmp_path):
    directory = str(tmp_path / "ckpt")
    saver = Checkpointer(directory, rdzv_generation=3)
    _save(saver, 1)
    path = os.path.join(directory, "step-1", "manifest.json")
    with open(path) as fh:
        manifest = json.load(fh)
    assert (manifest["generation"], manifest["rdzv_generation"]) == (3, 3)
    manifest["generation"] = "3"
    with open(path, "w") as fh:
        json.dump(manifest, fh)
    with pytest.raises(CheckpointError, match=r"manifest is malformed \(generation '3' is not "
                                              r"a whole number >= 0\)"):
        validate(os.path.join(directory, "step-1"))


def _count_under_lock(directory: str, counter: str, times: int) -> None:
    for _ in range(times):
        with CommitLock(directory):
            with open(counter) as fh:
                value = int(fh.read())
            time.sleep(0.001)  # a lost update needs only one overlap
            with open(counter, "w") as fh:
                fh.write(str(value + 1))
    os._exit(0)


def test_the_commit_lock_is_exclusive_between_processes(tmp_path):
    directory = str(tmp_path)
    counter = tmp_path / "counter"
    counter.write_text("0")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_count_under_lock, args=(directory, str(counter), 25))
             for _ in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert [p.exitcode for p in procs] == [0] * 4
    assert counter.read_text() == "100"
    assert sorted(os.listdir(tmp_path)) == ["counter"]  # no lock, no attempt file left


def _hold(directory: str, record: dict | None, held: object, done: object) -> None:
    lock = CommitLock(directory)
    lock.acquire()
    if record is not None:  # pretend another host holds it
        with open(lock.path, "w") as fh:
            json.dump(record, fh)
    held.set()
    done.wait(60)
    os._exit(0)


def test_stale_locks_are_broken_a_live_one_is_waited_for(tmp_path):
    """A lock of a dead process of this host goes at once; one of another host once it stayed
    the same for the stale age; a holder that lost its lock learns it before acting."""
    directory = str(tmp_path)
    ctx = mp.get_context("fork")
    held, done = ctx.Event(), ctx.Event()
    dead = ctx.Process(target=_hold, args=(directory, None, held, done))
    dead.start()
    assert held.wait(60)
    dead.kill()
    dead.join(60)
    assert os.path.exists(tmp_path / ".commit.lock")
    with CommitLock(directory, stale_after=3600, wait_limit=60):  # dead here: broken at once
        pass
    other = {"host": "another-host.invalid", "pid": 4242, "token": "t" * 32, "at": 0}
    held, done = ctx.Event(), ctx.Event()
    alive = ctx.Process(target=_hold, args=(directory, other, held, done))
    alive.start()
    try:
        assert held.wait(60)
        with pytest.raises(CheckpointError, match="the commit lock is still held by pid 4242 on "
                                                  "host another-host.invalid"):
            CommitLock(directory, stale_after=3600, wait_limit=0.5).acquire()
        with CommitLock(directory, stale_after=0.3):  # unchanged for its stale age: broken
            pass
    finally:
        done.set()
        alive.join(60)
    (tmp_path / ".commit.lock").write_text("")  # a record lost in a crash: judged by age
    with CommitLock(directory, stale_after=0.3):
        pass
    first = CommitLock(directory)
    first.acquire()
    first.ensure()
    # another takes it from a holder frozen for longer than the stale age
    with CommitLock(directory, stale_after=0.3), pytest.raises(LockLost):
        first.ensure()
    first.release()  # releasing a lost lock removes nothing of another holder's
    assert not os.path.exists(tmp_path / ".commit.lock")


def test_a_lock_left_by_a_killed_commit_is_cleared_by_the_sweep(tmp_path):
    directory = str(tmp_path)
    ctx = mp.get_context("fork")
    held, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold, args=(directory, None, held, done))
    proc.start()
    assert held.wait(60)
    assert not clear_dead_lock(directory)  # alive: kept
    proc.kill()
    proc.join(60)
    assert clear_dead_lock(directory)
    assert os.listdir(tmp_path) == []


def test_pruning_leaves_the_temporaries_of_a_live_commit_alone(tmp_path):
    """Another writer of the folder holds the commit lock while it writes `.generation-*`
    (its draw) or `.latest-*`: a prune waits for the lock and removes only what a killed writer
    left. (A pruner that did not wait removed another run's draw before its rename: CI saw
    `cannot draw a generation ... No such file or directory` in the race test above.)"""
    from distrun_safetensors.retention import prune

    directory = str(tmp_path)
    ctx = mp.get_context("fork")
    held, done = ctx.Event(), ctx.Event()
    writer = ctx.Process(target=_hold, args=(directory, None, held, done))
    writer.start()
    pruner = None
    try:
        assert held.wait(60)
        temporaries = [tmp_path / ".generation-0123abcd", tmp_path / ".latest-89abcdef"]
        for path in temporaries:
            path.write_text("being written")
        pruner = threading.Thread(target=prune, args=(directory, "", 0))
        pruner.start()
        pruner.join(1.0)  # it waits on the live holder's lock ...
        assert pruner.is_alive() and all(p.exists() for p in temporaries)
    finally:
        done.set()  # ... and once the holder is gone, what it left is a leftover
        writer.join(60)
        if pruner is not None:
            pruner.join(60)
    assert pruner is not None and not pruner.is_alive()
    assert os.listdir(tmp_path) == []
