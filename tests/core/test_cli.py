"""The distrun command as a user types it: help, version, plugins, strategies, env.

In-process (the `cli` fixture, click's CliRunner), except the torch-free check, which needs a
fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from distrun import __version__

NO_TORCH = """
import sys
from distrun._cli.main import main
try:
    main({args!r})
except SystemExit:
    pass
print("TORCH_IMPORTED" if "torch" in sys.modules else "TORCH_FREE", file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], ["plugins"], ["run", "--help"], ["--version"],
                                  ["strategies"]])
def test_cli_does_not_import_torch(args):
    """`distrun --help` and `distrun plugins` stay fast: no torch, with every plugin installed."""
    proc = subprocess.run([sys.executable, "-c", NO_TORCH.format(args=args)],
                          capture_output=True, text=True, timeout=60)
    assert proc.stderr.strip().splitlines()[-1] == "TORCH_FREE", proc.stderr


def test_version(cli):
    result = cli("--version")
    assert result.returncode == 0
    assert __version__ in result.stdout


def test_plugins_lists_builtins_with_hooks(cli):
    result = cli("plugins")
    assert result.returncode == 0, result
    assert f"core {__version__} (built-in)" in result.stdout
    assert "    distrun_run_fit" in result.stdout


def test_plugins_json(cli):
    result = cli("plugins", "--json")
    data = {p["name"]: p for p in json.loads(result.stdout)}
    assert data["single"]["hooks"] == ["distrun_register_strategies"]
    assert data["core"]["builtin"] is True


def test_strategies_lists_single(cli):
    result = cli("strategies")
    assert result.returncode == 0
    assert result.stdout.splitlines()[0].split()[0] in {"single", "ddp", "dp", "fsdp", "rpc"}
    assert any(line.startswith("single ") for line in result.stdout.splitlines())


def test_env_report_for_bug_reports(cli):
    result = cli("env")
    assert result.returncode == 0, result
    out = result.stdout
    assert f"- Python version: {sys.version.split()[0]}" in out
    import torch

    assert f"- PyTorch version: {torch.__version__}" in out
    assert "- Backends (--backend NAME):" in out
    assert any(line.split()[:2] == ["gloo", "available"] for line in out.splitlines())
    assert "- Plugins:" in out and "core" in out


def test_run_help_lists_core_and_torchrun_flags(cli):
    result = cli("run", "--help")
    assert result.returncode == 0
    for flag in ("--nproc-per-node", "--nproc_per_node", "--master-port", "--strategy",
                 "--config", "--tee", "--max-epochs", "--batch-size"):
        assert flag in result.stdout, flag
