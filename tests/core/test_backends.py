"""Backends as plugins: ``--backend``, its checks, and a plugin backend used end to end.

The plugin backend here is ``gloo2`` (tests/core/backend_plugin.py): torch's gloo registered
under a plugin's name when the worker loads it, which is what a compiled backend does.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from distrun._spec.backends import parse_backend
from distrun.testing import run_cli

HERE = Path(__file__).parent
PROBE = str(HERE / "backend_probe.py")


def _env(**extra: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "DISTRUN_PLUGINS": "backend_plugin", "DISTRUN_TIMEOUT": "60", **extra}


def test_parse_backend_names_and_device_maps():
    assert parse_backend("auto") == {}
    assert parse_backend("GLOO") == {"*": "gloo"}
    assert parse_backend("cpu:shm, cuda:nccl") == {"cpu": "shm", "cuda": "nccl"}
    for bad in ("cpu:", "cpu:gloo,cpu:shm", "gloo,nccl", "a b"):
        with pytest.raises(ValueError):
            parse_backend(bad)


@pytest.mark.parametrize("flags, message", [
    (["--backend", "glo"], "error: unknown backend 'glo'; did you mean 'gloo'? Installed: "),
    (["--backend", "cpu:nccl"],
     "error: backend 'nccl' serves cuda, not cpu (--backend cpu:NAME names the cpu backend)"),
    (["--backend", "cpu:,x"], "error: invalid value for --backend: 'cpu:,x' is not a device map"),
    (["--nnodes", "2", "--backend", "gloo2"],
     "error: backend 'gloo2' reaches the ranks of one machine only, but --nnodes is 2 (use "
     "--backend gloo for several nodes)"),
])
def test_bad_backends_are_one_line_before_any_worker(cli, monkeypatch, tmp_path, flags,
                                                     message):
    monkeypatch.syspath_prepend(str(HERE))
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    result = cli("run", *flags, str(script), cwd=tmp_path,
                 env={"DISTRUN_PLUGINS": "backend_plugin"})
    assert result.returncode == 2, result
    assert result.stderr.startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_backend_that_cannot_run_here_exits_2_in_one_line(tmp_path):
    result = run_cli("run", "--nproc-per-node", "2", "--backend", "never", PROBE, "plain",
                     cwd=tmp_path, env=_env())
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert lines and lines[0].startswith(
        "error: backend 'never' cannot run here: it needs a device this machine lacks "
        "(available here: gloo, gloo2"), result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("backend", ["gloo2", "cpu:gloo2"])
def test_a_plain_script_gets_the_plugin_backend_without_naming_it(tmp_path, backend):
    loads = tmp_path / "loads.txt"
    result = run_cli("run", "--nproc-per-node", "2", "--backend", backend, PROBE, "plain",
                     cwd=tmp_path, env=_env(BACKEND_PLUGIN_LOADS=str(loads)))
    assert result.returncode == 0, result
    for rank in (0, 1):  # init_process_group() with no backend: the plugin's, and it works
        assert f"rank {rank} backend cpu:gloo2 sum 3" in result.stdout, result
    assert len(loads.read_text().split()) == 2  # loaded once per worker


def test_distruns_group_and_its_mesh_use_the_backend_with_the_timeout(tmp_path):
    result = run_cli("run", "--nproc-per-node", "2", "--backend", "gloo2", PROBE, "mesh",
                     cwd=tmp_path, env=_env())
    assert result.returncode == 0, result
    for rank in (0, 1):
        # the sub-group is the plugin's backend too, with the collective timeout (not 30 min)
        assert f"rank {rank} mesh tp gloo2 7s" in result.stdout, result
        assert f"rank {rank} backend cpu:gloo2 sum 3" in result.stdout, result


def test_env_lists_each_backend_with_availability(cli, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    result = cli("env", env={"DISTRUN_PLUGINS": "backend_plugin"})
    assert result.returncode == 0, result
    lines = {line.split()[0]: line for line in result.stdout.splitlines()
             if line.startswith("    ") and ("available" in line)}
    assert lines["gloo"].split()[1] == "available" and "[cpu, cuda; core]" in lines["gloo"]
    assert "unavailable: it needs a device this machine lacks" in lines["never"]
    assert "[cpu; backend_plugin]" in lines["gloo2"]
    import torch

    if not torch.cuda.is_available():
        assert "unavailable: " in lines["nccl"]


def test_a_cpu_backend_on_a_gpu_run_is_told_the_device_map(monkeypatch):
    import torch.distributed as dist

    from distrun._config.run_config import RunConfig
    from distrun._registry.manager import make_plugin_manager
    from distrun._spec.errors import UsageError
    from distrun._strategies.process_group import prepare_backend

    monkeypatch.syspath_prepend(str(HERE))
    # loading gloo2 makes it torch's CPU default in this process: undone after the test
    monkeypatch.setattr(dist.Backend, "default_device_backend_map",
                        dict(dist.Backend.default_device_backend_map))
    pm = make_plugin_manager(extra=["backend_plugin"])
    with pytest.raises(UsageError) as err:
        prepare_backend(RunConfig(backend="gloo2"), "cuda", pm=pm)
    assert str(err.value) == ("backend 'gloo2' serves cpu but this run is on cuda (use a device "
                              "map such as --backend cpu:gloo2,cuda:nccl, or --device cpu)")
    assert prepare_backend(RunConfig(backend="cpu:gloo2"), "cuda", pm=pm) == "cpu:gloo2,cuda:nccl"
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo2"
