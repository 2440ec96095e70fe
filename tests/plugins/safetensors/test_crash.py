"""kill -9 at every durable point of a save: `latest` always loads a complete checkpoint."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

from st_layouts import build, compare, full_state, train_step
from st_plugin import kill_at as kill_at_point

from distrun_safetensors.load import load
from distrun_safetensors.save import Checkpointer
from distrun_safetensors.validation import validate


def _save_and_maybe_die(directory: str, step: int, kill_at: int, async_save: bool) -> None:
    kill_at_point(kill_at)
    model, opt = build("plain", seed=step)
    train_step(model, opt, step)
    saver = Checkpointer(directory, keep_last=1, async_save=async_save)
    saver.save(step, model, opt, {"progress": {"step": step}})
    if async_save:  # training moves on while the background thread writes the snapshot
        train_step(model, opt, step + 100)
    saver.wait()  # the pruning of the other step runs in the background: kills hit it too
    os._exit(0)


def _kill_at_every_point(directory: str, step_of: object,
                         async_save: bool = False) -> tuple[int, list[str]]:
    """Save (in a forked child) killed at event k = 1, 2, ... until a save completes; after
    each, `latest` must load a checkpoint whose tensors are exactly that step's."""
    ctx = mp.get_context("fork")
    loaded: list[str] = []
    for k in range(1, 40):
        child = ctx.Process(target=_save_and_maybe_die,
                            args=(directory, step_of(k), k, async_save))
        child.start()
        child.join(120)
        assert child.exitcode in (0, -signal.SIGKILL), child.exitcode
        fresh, fresh_opt = build("plain", seed=99)
        result = load("latest", fresh, fresh_opt, ckpt_dir=directory)
        assert result is not None, f"nothing loadable after a kill at point {k}"
        validate(result.path)
        loaded.append(os.path.basename(result.path))
        ref_model, ref_opt = build("plain", seed=result.step)
        train_step(ref_model, ref_opt, result.step)
        assert compare(full_state(fresh, fresh_opt), full_state(ref_model, ref_opt)) == []
        if child.exitcode == 0:
            return k - 1, loaded
    raise AssertionError("the save never completed without a kill")


def test_kill_during_an_async_write_leaves_latest_loadable(tmp_path):
    """--ckpt-async: the process dies while the background thread writes; what loads is
    always a complete checkpoint holding the snapshot's tensors, never the later ones."""
    directory = str(tmp_path / "ckpt")
    model, opt = build("plain", seed=1)
    train_step(model, opt, 1)
    Checkpointer(directory, keep_last=1).save(1, model, opt, {"progress": {"step": 1}})
    killed, loaded = _kill_at_every_point(directory, lambda k: 2 + k % 2, async_save=True)
    assert killed >= 10, f"only {killed} kill points were exercised"
    assert loaded[0] == "step-1" and loaded[-1] in ("step-2", "step-3")


def test_kill_at_every_point_of_a_save_leaves_latest_loadable(tmp_path):
    directory = str(tmp_path / "ckpt")
    model, opt = build("plain", seed=1)
    train_step(model, opt, 1)
    Checkpointer(directory, keep_last=1).save(1, model, opt, {"progress": {"step": 1}})
    # new steps (2 and 3 alternate, so kills also hit the pruning of the other one)
    killed, loaded = _kill_at_every_point(directory, lambda k: 2 + k % 2)
    assert killed >= 10, f"only {killed} kill points were exercised"
    assert loaded[0] == "step-1" and loaded[-1] in ("step-2", "step-3")
    # saving the step `latest` names again (a resumed run): the old folder is moved aside
    # first; a kill right then must fall back to it
    again = int(loaded[-1].split("-")[1])
    killed, loaded = _kill_at_every_point(directory, lambda k: again)
    assert killed >= 10
    assert any(name.startswith(".old-step-") for name in loaded), loaded


def _hold_a_save_open(directory: str, started: object, release: object) -> None:
    """A live save of another run: its temporary folder and the lock on it, held open."""
    from distrun_safetensors.leftovers import claim

    tmp = os.path.join(directory, ".tmp-step-9-live0000")
    claim(tmp)
    os.mkdir(tmp)
    started.set()
    release.wait(60)


def test_leftovers_of_a_killed_save_go_at_the_next_start_but_a_live_save_stays(tmp_path):
    from distrun_safetensors.leftovers import sweep_stale

    directory = str(tmp_path / "ckpt")
    os.makedirs(directory)
    # a save killed -9 after its first file: the temporary folder stays behind
    child = mp.get_context("fork").Process(target=_save_and_maybe_die,
                                           args=(directory, 2, 1, False))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    stale = [n for n in os.listdir(directory) if n.startswith(".tmp-step-2-")]
    assert stale and any(os.path.isdir(os.path.join(directory, n)) for n in stale)
    # another run saving into the same folder right now
    ctx = mp.get_context("fork")
    started, release = ctx.Event(), ctx.Event()
    live = ctx.Process(target=_hold_a_save_open, args=(directory, started, release))
    live.start()
    try:
        assert started.wait(60)
        removed = sweep_stale(directory)
        assert sorted(removed) == sorted(os.path.join(directory, n) for n in stale
                                         if not n.endswith(".lock"))
        left = sorted(os.listdir(directory))
        assert left == [".generation", ".tmp-step-9-live0000", ".tmp-step-9-live0000.lock"], left
    finally:
        release.set()
        live.join(60)
    # its writer gone too, the next sweep takes the live one's folder as well
    assert sweep_stale(directory) == [os.path.join(directory, ".tmp-step-9-live0000")]
    assert os.listdir(directory) == [".generation"]  # the newest generation drawn (fencing)


def _foreign_leftover(directory: str, name: str, age: float) -> str:
    """A temporary folder whose lock records a writer on another host, last touched ``age``
    seconds ago (its flock may be invisible from here, as on NFS)."""
    import json
    import time

    path = os.path.join(directory, name)
    os.mkdir(path)
    with open(os.path.join(path, "model-00001-of-00001.safetensors"), "wb") as fh:
        fh.write(b"partial")
    with open(path + ".lock", "w") as fh:
        json.dump({"host": "another-host.invalid", "pid": 4242, "started": time.time()}, fh)
    when = time.time() - age
    for p in (path, path + ".lock", os.path.join(path, "model-00001-of-00001.safetensors")):
        os.utime(p, (when, when))
    return path


def test_ls_shows_a_killed_save_as_abandoned_and_clean_removes_only_those(cli, tmp_path):
    """Issue 26 item 8: a save killed -9 leaves its temporary folder and lock until the next
    commit; `ckpt ls` shows it ABANDONED (its writer is gone), `ckpt clean` removes it, and
    leaves alone a save another process is writing and one of another host that is recent."""
    import re

    directory = str(tmp_path / "ckpt")
    model, opt = build("plain", seed=1)
    Checkpointer(directory).save(1, model, opt, {"progress": {"step": 1}})
    child = mp.get_context("fork").Process(target=_save_and_maybe_die,
                                           args=(directory, 2, 1, False))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    killed = [n for n in os.listdir(directory) if n.startswith(".tmp-step-2-")]
    assert len(killed) == 2, killed  # the folder and its lock
    killed_dir = min(killed)
    _foreign_leftover(directory, ".tmp-step-4-0000aaaa", age=5000)
    _foreign_leftover(directory, ".tmp-step-5-0000bbbb", age=0)
    ctx = mp.get_context("fork")
    started, release = ctx.Event(), ctx.Event()
    live = ctx.Process(target=_hold_a_save_open, args=(directory, started, release))
    live.start()
    try:
        assert started.wait(60)
        listing = cli("ckpt", "ls", directory, "--timeout", "600")
        assert listing.returncode == 0, listing
        lines = listing.stdout.splitlines()
        assert lines[0].startswith("* step-1 ") and len(lines) == 6, lines
        assert lines[1] == (f"  {killed_dir:<16} step 2  ABANDONED: pid {child.pid} on this host "
                            "is gone (a save that never committed)")
        assert re.fullmatch(r"  \.tmp-step-4-0000aaaa step 4  ABANDONED: written by pid 4242 on "
                            r"host another-host\.invalid, untouched for 5\d\d\d s \(longer than "
                            r"the timeout, 600 s\)", lines[2]), lines[2]
        assert re.fullmatch(r"  \.tmp-step-5-0000bbbb step 5  in progress: written by pid 4242 "
                            r"on host another-host\.invalid \d+ s ago \(may still be saving; "
                            r"abandoned once untouched for 600 s\)", lines[3]), lines[3]
        assert lines[4] == (f"  .tmp-step-9-live0000 step 9  in progress: being written by pid "
                            f"{live.pid} on this host")
        assert lines[5] == f"(`distrun ckpt clean {directory}` removes the abandoned saves)"
        dry = cli("ckpt", "clean", directory, "--timeout", "600", "--dry-run")
        assert dry.returncode == 0 and "would remove 2 abandoned save(s), kept 2" in dry.stdout
        assert len(os.listdir(directory)) == 11  # nothing removed
        cleaned = cli("ckpt", "clean", directory, "--timeout", "600")
        assert cleaned.returncode == 0, cleaned
        assert f"removed {killed_dir}: pid {child.pid} on this host is gone" in cleaned.stdout
        assert cleaned.stdout.splitlines()[-1] == (
            f"{directory}: removed 2 abandoned save(s), kept 2 in progress")
        assert sorted(os.listdir(directory)) == [
            ".generation", ".tmp-step-5-0000bbbb", ".tmp-step-5-0000bbbb.lock", ".tmp-step-9-live0000",
            ".tmp-step-9-live0000.lock", "latest", "step-1"]
    finally:
        release.set()
        live.join(60)
    # its writer gone, the live one's save is abandoned too; the recent foreign one stays
    cleaned = cli("ckpt", "clean", directory)
    assert "removed .tmp-step-9-live0000" in cleaned.stdout, cleaned
    assert sorted(os.listdir(directory)) == [
        ".generation", ".tmp-step-5-0000bbbb", ".tmp-step-5-0000bbbb.lock", "latest", "step-1"]
    assert cli("ckpt", "verify", directory).returncode == 0  # the checkpoint is untouched



def test_the_sweep_at_a_run_start_judges_other_hosts_saves_by_the_run_timeout(tmp_path):
    """What a run's start (and pruning, without a timeout) removes of other hosts' saves."""
    from distrun_safetensors.leftovers import sweep_stale

    directory = str(tmp_path / "ckpt")
    os.makedirs(directory)
    old = _foreign_leftover(directory, ".tmp-step-4-0000aaaa", age=5000)
    recent = _foreign_leftover(directory, ".tmp-step-5-0000bbbb", age=0)
    assert sweep_stale(directory) == []  # pruning after a commit: this host's only
    assert sweep_stale(directory, timeout=6000) == []  # younger than the run's timeout
    assert sweep_stale(directory, timeout=600) == [old]
    assert sorted(os.listdir(directory)) == [os.path.basename(recent),
                                             os.path.basename(recent) + ".lock"]
