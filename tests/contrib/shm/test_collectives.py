"""Every collective against a reference computed in the test: bit-equal (see README)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from distrun.testing import imports_torch, run_cli, run_on_ranks

sys.path.insert(0, os.path.dirname(__file__))  # shm_ranks, importable by spawned ranks too
import shm_ranks  # noqa: E402


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_every_op_dtype_and_size(world):
    for errors in run_on_ranks(shm_ranks.check_all_reduce, world, timeout=120):
        assert errors == []


@pytest.mark.parametrize("world", [2, 3])
def test_other_collectives(world):
    for errors in run_on_ranks(shm_ranks.check_other_collectives, world, timeout=120):
        assert errors == []


def test_subgroups_and_2x2_device_mesh():
    for errors in run_on_ranks(shm_ranks.check_subgroups_and_mesh, 4, timeout=120):
        assert errors == []


def test_unsupported_ops_are_clear_one_line_errors():
    seen = run_on_ranks(shm_ranks.unsupported_op, 2, timeout=60)[0]
    assert seen["recv_anysource"].splitlines() == [
        "Backend shm does not support recvAnysource"]
    assert seen["uint32"].splitlines() == [
        "shm backend: allreduce does not support dtype UInt32 (float32, float64, bfloat16, "
        "float16, int8/16/32/64, uint8, bool)"]
    assert seen["band_float"].splitlines() == [
        "shm backend: allreduce: BAND is not defined on float32"]
    assert seen["after"] == "[2.0, 2.0]"


def test_group_over_two_machines_is_refused_naming_gloo():
    for text in run_on_ranks(shm_ranks.other_machine, 2, timeout=60):
        assert text.startswith("UsageError: the shm backend reaches ranks of one machine only"), \
            text
        assert text.endswith("use --backend gloo for a run over several nodes")
        assert len(text.splitlines()) == 1


def test_entry_point_and_check_import_no_torch():
    assert not imports_torch("distrun_shm.plugin", "distrun_shm.build")


def test_cached_build_loads_silently_and_prebuild_command():
    code = "import distrun_shm.backend as b; b.load(); print('loaded')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout == "loaded\n" and out.stderr == ""
    pre = subprocess.run([sys.executable, "-m", "distrun_shm"], capture_output=True, text=True)
    assert pre.returncode == 0 and pre.stdout.startswith("distrun-shm: ready ("), pre


def test_distrun_env_lists_shm_available():
    res = run_cli("env")
    assert res.returncode == 0, res
    line = next(ln for ln in res.stdout.splitlines() if ln.strip().startswith("shm "))
    assert "available" in line and "distrun-shm" in line, line


def test_failed_build_is_the_check_reason(tmp_path):
    # A fresh cache and a compiler that does not exist: the build fails once, says so in one
    # line with the log's path, and the check then gives that reason without building again.
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), CXX="/nonexistent/c++")
    code = ("from distrun_shm import build\n"
            "try:\n    build.load_extension()\nexcept build.BuildError as e:\n"
            "    print('ERR', e)\nprint('CHECK', build.unavailable())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ERR its build failed: ") and "(log: " in lines[0], out
    assert lines[1] == "CHECK " + lines[0][4:], out
    assert out.stderr.count("distrun-shm: compiling the shared-memory backend") == 1
