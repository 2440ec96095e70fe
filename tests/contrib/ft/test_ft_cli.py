"""What --ft refuses: one line each, exit 2, before any worker or lighthouse starts."""

from __future__ import annotations

import socket

import pytest

from distrun.testing import run_cli

BASE = ["--ft", "--replica-groups", "2", "--nproc-per-node", "2", "--strategy", "ddp",
        "--batch-size", "16", "--max-steps", "2"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens there once this socket closes


@pytest.mark.parametrize("extra, says", [
    (["--max-restarts", "2"], "use --ft-max-restarts N instead of --max-restarts"),
    (["--strategy", "pp"], "--ft does not support pipeline parallelism"),
    # 127.0.0.2 is loopback but no interface's address: another host's lighthouse, not up
    (["--ft-lighthouse", "http://127.0.0.2:{port}", "--timeout", "6", "--ft-heartbeat", "0.5"],
     "cannot reach the torchft lighthouse at http://127.0.0.2"),
    (["--timeout", "8", "--ft-heartbeat", "2"], "--timeout 8 is too short for --ft-heartbeat 2"),
    (["--batch-size", "2"], "--batch-size 2 is smaller than the 4 ranks"),
    (["--strategy", "deepspeed"], "--ft does not support --strategy deepspeed (DeepSpeed's"),
    (["--strategy", "rpc"], "--ft does not support --strategy rpc"),
    (["--strategy", "dp", "--nproc-per-node", "1"], "--ft does not support --strategy dp"),
    (["--strategy", "tp"], "--ft does not support --strategy tp"),
    (["--strategy", "fsdp", "--tp-size", "2"], "--ft does not support tp parallelism"),
    (["--zero"], "--ft does not support --zero"),
], ids=["max-restarts", "pipeline", "lighthouse-unreachable", "timeouts", "batch", "deepspeed",
        "rpc", "dp", "tp", "fsdp-tp-size", "zero"])
def test_refused_in_one_line(ft, tmp_path, extra, says):
    extra = [e.format(port=_closed_port()) for e in extra]
    r = run_cli("run", *BASE, *extra, "ft_task:Task", cwd=tmp_path, env=ft.env(tmp_path),
                timeout=60)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in r.output, r
    assert not list(tmp_path.glob("pid-*")), "a worker started"


def test_torchft_missing(ft, tmp_path):
    # torchft made unimportable in the launcher (as if not installed): a sitecustomize that
    # marks it absent from sys.modules
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['torchft'] = None\n")
    env = ft.env(tmp_path)
    env["PYTHONPATH"] = f"{shim}:{env['PYTHONPATH']}"
    r = run_cli("run", *BASE, "ft_task:Task", cwd=tmp_path, env=env, timeout=60)
    assert r.returncode == 2, r
    assert r.stderr.strip() == ("error: --ft needs torchft: pip install "
                                "'torchft-nightly==2026.10.26'"), r
