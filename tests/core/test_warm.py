"""The warm pool (distrun.plugin.WorkerGroup.spares): workers forked from a spare that imported torch."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import pytest

from distrun._launch.lifeline import pid_alive
from distrun._launch.warm import WarmPool, warm_command

WORKER = [sys.executable, "-u", "-m", "distrun._worker.main"]


def test_warm_command_is_the_zygote_with_the_workers_interpreter_and_flags():
    assert warm_command([*WORKER, "--script", "a.py"]) == [
        sys.executable, "-u", "-m", "distrun._worker.zygote"]
    assert warm_command(["/bin/true", "-m", "distrun._worker.main"]) == [
        "/bin/true", "-m", "distrun._worker.zygote"]
    assert warm_command(["torchrun", "a.py"]) is None
    assert warm_command([sys.executable, "-X", "dev", "-m", "distrun._worker.main"]) is None
    with pytest.raises(ValueError, match="not a distrun worker command"):
        WarmPool(["./run.sh"], 1)


def test_spawn_forks_workers_with_their_env_streams_and_exit_codes(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys
        print(os.environ["ANSWER"], os.getcwd(), sys.argv[1:], "torch" in sys.modules)
        print("to stderr", file=sys.stderr)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(sys.argv[1]))
    """))
    work = tmp_path / "work"
    work.mkdir()
    pool = WarmPool([*WORKER, "--script", str(script)], 1, env={**os.environ, "ANSWER": "0"})
    spares = list(pool.pids().values())
    try:
        codes = {}
        for arg in ("3", "kill", "0"):
            out = tmp_path / f"{arg}.out"
            with open(out, "w") as fh:
                proc = pool.spawn(0, [*WORKER, "--script", str(script), arg],
                                  {**os.environ, "ANSWER": "42"}, (0, fh.fileno(), fh.fileno()),
                                  cwd=str(work))
                assert proc is not None, pool.zygotes[0].why
                codes[arg] = proc.wait(timeout=120)
            assert pool.state(0) == "ready"
            text = out.read_text()
            assert f"42 {work} ['{arg}'] True" in text  # torch came preloaded
            assert "to stderr" in text
        assert codes == {"3": 3, "kill": -signal.SIGKILL, "0": 0}
        # not the worker entry point: the caller starts it cold
        assert pool.spawn(0, [sys.executable, "-c", "pass"], dict(os.environ)) is None
        os.kill(spares[0], signal.SIGKILL)
        assert pool.spawn(0, [*WORKER, "--script", str(script), "0"], dict(os.environ)) is None
        assert pool.state(0) == "gone"
        pool.renew()  # a new spare, importing torch in the background
        assert pool.pids()[0] != spares[0]
        spares.append(pool.pids()[0])
    finally:
        pool.close()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in spares) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in spares if pid_alive(p)]
