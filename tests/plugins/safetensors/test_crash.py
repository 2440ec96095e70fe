"""kill -9 at every durable point of a save: `latest` always loads a complete checkpoint."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

from distrun_safetensors.load import load
from distrun_safetensors.manifest import validate
from distrun_safetensors.save import Checkpointer
from st_layouts import build, compare, full_state, train_step


def _save_and_maybe_die(directory: str, step: int, kill_at: int) -> None:
    os.environ["DISTRUN_CKPT_TEST_KILL_AT"] = str(kill_at)
    model, opt = build("plain", seed=step)
    train_step(model, opt, step)
    Checkpointer(directory, keep_last=1).save(step, model, opt, {"progress": {"step": step}})
    os._exit(0)


def test_kill_at_every_point_of_a_save_leaves_latest_loadable(tmp_path):
    directory = str(tmp_path / "ckpt")
    model, opt = build("plain", seed=1)
    train_step(model, opt, 1)
    Checkpointer(directory, keep_last=1).save(1, model, opt, {"progress": {"step": 1}})
    ctx = mp.get_context("fork")
    killed, steps_seen = 0, set()
    for k in range(1, 40):
        # alternate steps 2 and 3 so some saves replace an existing step-N folder
        step = 2 + k % 2
        child = ctx.Process(target=_save_and_maybe_die, args=(directory, step, k))
        child.start()
        child.join(120)
        assert child.exitcode in (0, -signal.SIGKILL), child.exitcode
        fresh, fresh_opt = build("plain", seed=99)
        result = load("latest", fresh, fresh_opt, ckpt_dir=directory)
        assert result is not None, f"nothing loadable after a kill at point {k}"
        validate(result.path)
        steps_seen.add(result.step)
        ref_model, ref_opt = build("plain", seed=result.step)
        train_step(ref_model, ref_opt, result.step)
        assert compare(full_state(fresh, fresh_opt), full_state(ref_model, ref_opt)) == []
        if child.exitcode == 0:
            break
        killed += 1
    assert child.exitcode == 0, "the save never completed without a kill"
    assert killed >= 10, f"only {killed} kill points were exercised"
    assert steps_seen >= {1, 2, 3} or steps_seen >= {2, 3}
