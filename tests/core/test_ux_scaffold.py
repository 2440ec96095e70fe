"""`distrun plugin new NAME`: the generated plugin installs with pip, is listed, and its own
tests pass. It is installed into a throwaway venv that sees this environment's packages
through a .pth file, so concurrent test runs never see a half-installed plugin."""

from __future__ import annotations

import subprocess
import sys

import pytest
import tomllib

from distrun.testing import run_cli

pytest.importorskip("setuptools", reason="building the plugin needs setuptools")


def layered_venv(path) -> str:
    """A venv whose site-packages adds this interpreter's site dirs (and runs their .pth
    files: editable installs); works from a plain interpreter, a venv or a tox env."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=120)
    site_dirs = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    (site_packages,) = path.glob("lib/python*/site-packages")
    (site_packages / "_distrun_parent_env.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site_dirs) + "\n")
    return str(path / "bin" / "python")


def pip(venv_python: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--python", venv_python, *args,
                           "--disable-pip-version-check", "-q"], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_new_plugin_installs_lists_and_passes_its_tests(tmp_path):
    result = run_cli("plugin", "new", "step_count", "--summary", "Counts steps", cwd=tmp_path)
    assert result.returncode == 0, result
    root = tmp_path / "step_count"
    expected = {"pyproject.toml", "README.md", "tox.ini", "distrun_step_count/__init__.py",
                "distrun_step_count/plugin.py", "distrun_step_count/py.typed",
                "tests/test_step_count.py"}
    assert {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} == expected
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "distrun-step-count"
    assert meta["project"]["entry-points"]["distrun"] == {"step_count":
                                                          "distrun_step_count.plugin"}
    assert "contrib-step_count: -e plugins_contrib/step_count" in result.stdout

    py = layered_venv(tmp_path / "venv")
    installed = pip(py, "install", "--no-deps", "--no-build-isolation", str(root))
    assert installed.returncode == 0, installed.stderr

    listed = subprocess.run([py, "-m", "distrun", "plugins"], capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    block = listed.stdout.split("step_count 0.1.0 (distrun-step-count)\n")[1]
    hooks = [ln.strip() for ln in block.splitlines()[:4]]
    assert hooks == ["distrun_on_fit_end", "distrun_on_fit_start", "distrun_on_step_end",
                     "distrun_register_options"]
    # The generated plugin's own tests, run the way its author would.
    tests = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(root / "tests")], capture_output=True, text=True, timeout=600,
                           cwd=tmp_path)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "3 passed" in tests.stdout

    removed = pip(py, "uninstall", "-y", "distrun-step-count")
    assert removed.returncode == 0, removed.stderr
    after = subprocess.run([py, "-m", "distrun", "plugins"], capture_output=True, text=True,
                           timeout=120)
    assert "step_count" not in after.stdout
    # It never reached this environment.
    assert "step_count" not in run_cli("plugins").stdout


def test_generated_plugin_is_torch_free_and_lint_clean(cli, tmp_path):
    cli("plugin", "new", "tidy", cwd=tmp_path)
    plugin = tmp_path / "tidy" / "distrun_tidy" / "plugin.py"
    code = (f"import importlib.util, sys; s = importlib.util.spec_from_file_location('p', "
            f"{str(plugin)!r}); m = sys.modules['p'] = importlib.util.module_from_spec(s); "
            "s.loader.exec_module(m);"
            " print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated",
                           "--select", "E,F,W,B,UP", str(tmp_path / "tidy")],
                          capture_output=True, text=True)
    if "No module named ruff" in ruff.stderr:
        pytest.skip("ruff is not installed")
    assert ruff.returncode == 0, ruff.stdout


@pytest.mark.parametrize("name", ["Bad", "9lives", "has-dash", ""])
def test_bad_names_are_usage_errors(cli, tmp_path, name):
    result = cli("plugin", "new", name, cwd=tmp_path)
    assert result.returncode == 2
    assert f"invalid plugin name {name!r}" in result.stderr


def test_existing_folder_is_not_overwritten(cli, tmp_path):
    (tmp_path / "taken").mkdir()
    result = cli("plugin", "new", "taken", cwd=tmp_path)
    assert result.returncode == 2
    assert "already exists" in result.stderr
