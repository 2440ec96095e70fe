"""Every bad input of issue 15, table-driven: the exit code, the exact line, nothing written,
nothing read outside.

Launcher-side inputs run in-process (the ``cli`` fixture: no worker may start), with an audit
hook that records every file opened; inputs only a worker can meet run a real ``distrun``
subprocess. Checkpoint inputs are in tests/plugins/safetensors/test_ckpt_bad_input.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from distrun._launch.binding import interface_addresses
from distrun.testing import run_cli

TASK = """
import os, sys, time
import torch
import distrun

if os.environ.get("STUCK_RANK") == os.environ.get("RANK"):
    time.sleep(120)  # stuck at import, before training


class T(distrun.Task):
    def configure_model(self):
        return torch.nn.Linear(2, 1)

    def train_data(self):
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.TensorDataset(torch.randn(64, 2, generator=g),
                                              torch.randn(64, 1, generator=g))

    def training_step(self, model, batch):
        x, y = batch
        if os.environ.get("RETURN_NONE"):
            return None
        loss = torch.nn.functional.mse_loss(model(x), y)
        return loss * float("nan") if os.environ.get("NAN_LOSS") else loss
"""
IMPORT_ERROR = """
import os, time
if os.environ["RANK"] == "1":
    import no_such_module_here
time.sleep(30)
"""


@dataclass
class Case:
    args: tuple[str, ...]
    line: str  # the exact error line
    code: int = 2
    make: dict[str, str] = field(default_factory=dict)  # files to create first (path: text)
    dirs: tuple[str, ...] = ()
    skip: str = ""
    env: dict[str, str] = field(default_factory=dict)  # variables set for the call
    needs: tuple[str, ...] = ()  # plugin packages the case runs with (skipped without them)


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


#: the progress bar off where it is installed (blocking an absent plugin is a warning line)
NO_BAR = ("-p", "no:progress") if _installed("distrun_progress") else ()


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


# -- inputs the launcher refuses before any worker starts --------------------------------------
IN_PROCESS = {
    "master_port_too_big": Case(
        ("run", "--master-port", "70000", "task.py:T"),
        "error: invalid value for --master-port: 70000 is above the maximum 65535"),
    "master_port_torchrun_spelling": Case(
        ("run", "--master_port", "70000", "task.py"),
        "error: invalid value for --master-port: 70000 is above the maximum 65535"),
    "config_is_a_folder": Case(
        ("run", "--config", "cfg", "task.py:T"),
        "error: --config cfg is a folder; give the TOML file itself (e.g. cfg/config.toml)",
        dirs=("cfg",)),
    "resume_is_a_file": Case(
        ("run", "--resume", "weights.bin", "task.py:T"),
        "error: --resume weights.bin is a file; give a checkpoint folder (step-N), a "
        "checkpoints folder or a run folder", make={"weights.bin": "x"}),
    "nproc_zero": Case(
        ("run", "--nproc-per-node", "0", "task.py"),
        "error: invalid value for --nproc-per-node: '0' is too few: start at least 1 process "
        "(or use cpu, gpu or auto)"),
    "nproc_word": Case(
        ("run", "--nproc-per-node", "many", "task.py"),
        "error: invalid value for --nproc-per-node: 'many' is not a number of processes (use "
        "N >= 1, cpu, gpu or auto)"),
    "nproc_gpu_without_one": Case(
        ("run", "--nproc-per-node", "gpu", "task.py"),
        "error: --nproc-per-node gpu: no CUDA device is visible (use a number, cpu or auto)",
        skip="a CUDA device is visible" if _cuda() else ""),
    "strategy_of_a_blocked_plugin": Case(
        ("-p", "no:ddp", "run", "--strategy", "ddp", "task.py:T"),
        "error: strategy 'ddp' comes from plugin 'ddp', which is blocked (-p no:ddp or "
        "DISTRUN_BLOCK_PLUGINS); unblock it to use --strategy ddp"),
    "name_with_a_slash": Case(
        ("run", "--name", "a/b", "task.py:T"),
        "error: invalid value for --name: 'a/b' must be a plain folder name: no '/', '\\' or "
        "'..' (use --run-dir PATH to put the run folder elsewhere)"),
    "name_dotdot": Case(
        ("run", "--name", "..", "task.py:T"),
        "error: invalid value for --name: '..' must be a plain folder name: no '/', '\\' or "
        "'..' (use --run-dir PATH to put the run folder elsewhere)"),
    "name_climbing_in_a_config_file": Case(
        ("run", "--config", "run.toml", "task.py:T"),
        "error: invalid value for 'name' in run.toml: 'x/../../y' must be a plain folder name: "
        "no '/', '\\' or '..' (use --run-dir PATH to put the run folder elsewhere)",
        make={"run.toml": 'name = "x/../../y"\n'}),
    "syntax_error": Case(
        ("run", "--nproc-per-node", "2", "broken.py"),
        "error: broken.py:2: '(' was never closed: x = ( (fix the script; no worker was started)",
        make={"broken.py": "import os\nx = (\n"}),
    "syntax_error_in_a_task_file": Case(
        ("run", "broken.py:T"),
        "error: broken.py:2: '(' was never closed: x = ( (fix the script; no worker was started)",
        make={"broken.py": "import os\nx = (\n"}),
    "unknown_option_after_a_task": Case(
        ("run", "task.py:T", "--max-epoch", "5"),
        "error: No such option '--max-epoch'. (Did you mean one of: '--max-epochs', "
        "'--max-steps'?) (see `distrun run --help`)"),
    "torchrun_flag_distrun_cannot_honour": Case(
        ("run", "--numa-binding", "node", "task.py"),
        "error: torchrun's --numa-binding is not supported by distrun: NUMA binding is not "
        "supported (bind with numactl around `distrun run`) (see `distrun run --help`)"),
    "torchrun_redirects_value": Case(
        ("run", "--redirects", "9", "task.py"),
        "error: invalid value for --redirects: '9' is not a torchrun stream choice (0 none, 1 "
        "stdout, 2 stderr, 3 both; or per local rank, e.g. 0:3,1:0)"),
    "local_ranks_filter": Case(
        ("run", "--local-ranks-filter", "first", "task.py"),
        "error: invalid value for --local-ranks-filter: 'first' is not a comma-separated list "
        "of local ranks (e.g. 0 or 0,1)"),
    "no_python_with_module": Case(
        ("run", "--no-python", "-m", "pkg.mod"),
        "error: --no-python runs TARGET as an executable: it cannot go with -m/--module (as "
        "under torchrun)"),
    "no_python_not_executable": Case(
        ("run", "--no-python", "task.py"),
        "error: --no-python: task.py is not an executable file (check the path and its x bit, "
        "or drop --no-python for a Python script)"),
    "local_addr_of_another_host": Case(
        ("run", "--local-addr", "203.0.113.7", "task.py:T"),
        "error: --local-addr 203.0.113.7: it is not an address of this host (its addresses: "
        + ", ".join(f"{a} ({i})" for i, a in interface_addresses().items()) + ")"),
    "standalone_with_nodes": Case(
        ("run", "--standalone", "--nnodes", "2", "task.py"),
        "error: --standalone runs on one node but --nnodes is 2 (drop one of them)"),
    # issue 26 -------------------------------------------------------------------------------
    "run_dir_under_a_file": Case(  # the folder numbering looped forever
        ("run", "--run-dir", "FILE/run", "task.py:T"),
        "error: cannot make the run folder FILE/run: FILE is a file, not a folder (choose "
        "another --run-dir)", make={"FILE": "x"}),
    "run_dir_is_a_file": Case(
        ("run", "--run-dir", "FILE", "task.py:T"),
        "error: the run folder FILE is a file, not a folder (move it away, or choose another "
        "--run-dir or --name)", make={"FILE": "x"}),
    "run_dir_the_system_refuses": Case(  # was a 48-line launcher traceback
        ("run", "--run-dir", "/proc/distrun-run", "task.py:T"),
        "error: cannot make the run folder /proc/distrun-run: No such file or directory "
        "(choose another --run-dir)"),
    # found only in the workers before (10-27 s): the launcher checks a Task's layout now
    "tp_size_not_dividing_the_world": Case(  # said "for ?-way data parallel"
        ("run", "--nproc-per-node", "2", "--strategy", "tp", "--tp-size", "3", "task.py:T"),
        "error: --strategy tp splits layers over all 2 ranks but --tp-size is 3 (use "
        "--tp-size 2)", needs=("distrun_tp",)),
    "tp_size_not_the_world_under_tp": Case(
        ("run", "--nproc-per-node", "4", "--strategy", "tp", "--tp-size", "2", "task.py:T"),
        "error: --strategy tp splits layers over all 4 ranks but --tp-size is 2 (use "
        "--tp-size 4, or --strategy fsdp --tp-size 2 for 2-way data parallel x 2-way tensor "
        "parallel)", needs=("distrun_tp",)),
    "tp_size_not_dividing_the_world_under_fsdp": Case(
        ("run", "--nproc-per-node", "2", "--strategy", "fsdp", "--tp-size", "3", "task.py:T"),
        "error: --tp-size 3 does not divide the world size 2 (use a tensor-parallel size that "
        "divides 2, e.g. 1, 2)", needs=("distrun_fsdp", "distrun_tp")),
    "batch_size_not_dividing_the_world": Case(
        ("run", "--nproc-per-node", "3", "--batch-size", "32", "task.py:T"),
        "error: batch_size 32 is not divisible by 3 data-parallel ranks (batch_size is the "
        "global batch; use a multiple of 3)", needs=("distrun_ddp",)),
    "batch_size_not_dividing_the_data_parallel_ranks": Case(
        ("run", "--nproc-per-node", "4", "--strategy", "fsdp", "--tp-size", "2",
         "--batch-size", "3", "task.py:T"),
        "error: batch_size 3 is not divisible by 2 data-parallel ranks (batch_size is the "
        "global batch; use a multiple of 2)", needs=("distrun_fsdp", "distrun_tp")),
    "stage_without_its_step_method": Case(
        ("run", "--stage", "fit,test", "task.py:T"),
        "error: --stage test: T has no test_step(model, batch); define it (it returns the loss "
        "or a dict of metrics)"),
    # an option nothing reads is an error, not a run that ignores it
    "resume_with_the_checkpoint_plugin_blocked": Case(  # trained from scratch, exit 0
        ("-p", "no:safetensors", "run", "--resume", "ckpt", "task.py:T"),
        "error: --resume ckpt: no plugin reads it: 'safetensors', which implements "
        "distrun_load_checkpoint, is blocked (-p no:safetensors or DISTRUN_BLOCK_PLUGINS); "
        "unblock it, or drop --resume", dirs=("ckpt",), needs=("distrun_safetensors",)),
    "resume_with_no_checkpoint_plugin_installed": Case(
        ("run", "--resume", "ckpt", "task.py:T"),
        "error: --resume ckpt: no plugin reads it: no installed plugin implements "
        "distrun_load_checkpoint (install one that does: `distrun plugins` lists the installed "
        "ones and their hooks), or drop --resume", dirs=("ckpt",),
        env={"DISTRUN_DISABLE_PLUGIN_AUTOLOAD": "1"}),
    "signal_name": Case(
        ("run", "--signals-to-handle", "SIGTERM,SIGNOPE", "task.py"),
        "error: invalid value for --signals-to-handle: 'SIGTERM,SIGNOPE' names no signal "
        "SIGNOPE (use names such as SIGTERM,SIGINT,SIGHUP,SIGQUIT)"),
}

_opened: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)
_REPO = str(Path(__file__).resolve().parents[2])
_OURS = tuple({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, _REPO)}) + (
    "/dev/", "/proc/", "/sys/", "/etc/", "/usr/", "/lib")


def _setup(tmp_path: Path, case: Case) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "task.py").write_text(TASK)
    for name, text in case.make.items():
        (work / name).write_text(text)
    for name in case.dirs:
        (work / name).mkdir()
    (tmp_path / "outside").mkdir()
    return work


def _tree(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.lstat().st_mtime for p in root.rglob("*")}


@pytest.mark.parametrize("name", list(IN_PROCESS))
def test_launcher_refuses_bad_input_in_one_line(cli, tmp_path, name):
    global _opened
    case = IN_PROCESS[name]
    if case.skip:
        pytest.skip(case.skip)
    missing = [p for p in case.needs if not _installed(p)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    work = _setup(tmp_path, case)
    before = _tree(tmp_path)
    _opened = []
    try:
        result = cli(*case.args, cwd=work, env={"DISTRUN_BLOCK_PLUGINS": None, **case.env})
        opened = list(_opened)
    finally:
        _opened = None
    assert result.returncode == case.code, result
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines == [case.line], result
    assert "Traceback" not in result.output
    assert _tree(tmp_path) == before, "something was written"
    outside = [p for p in opened if not os.path.realpath(p).startswith(
        (os.path.realpath(work) + os.sep, *_OURS))]
    assert outside == [], outside


# -- inputs only a worker meets: real `distrun` processes ---------------------------------------


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "task.py").write_text(TASK)
    (work / "imports.py").write_text(IMPORT_ERROR)
    return work, run_cli(*NO_BAR, *args, cwd=work, env=env, timeout=120)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_training_step_returning_none_names_the_method_and_what_it_returned(tmp_path):
    work, result = _run(tmp_path, "run", "--no-summary", "--name", "none", "task.py:T",
                        env={"RETURN_NONE": "1"})
    assert result.returncode == 2, result
    assert _lines(result.stderr) == [
        "error: T.training_step(model, batch) returned None; it must return the loss as a "
        "torch.Tensor (e.g. `return F.mse_loss(model(x), y)`)"], result
    assert "Traceback" not in result.output
    assert sorted(os.listdir(work)) == ["imports.py", "runs", "task.py"]  # its run folder only


def test_an_import_error_on_one_rank_is_its_traceback_once_then_one_line(tmp_path):
    work, result = _run(tmp_path, "run", "--nproc-per-node", "2", "imports.py")
    assert result.returncode == 1, result
    err = result.stderr
    assert err.count("Traceback (most recent call last):") == 1, result
    assert err.count("ModuleNotFoundError: No module named 'no_such_module_here'") == 2, result
    assert _lines(err)[-1] == ("distrun: rank 1 failed with exit code 1: ModuleNotFoundError: "
                               "No module named 'no_such_module_here' (its output is above)")
    # the user's frames only, named as `python imports.py` names them (an absolute path):
    # none of the wrapper that ran the script
    assert f'File "{work / "imports.py"}", line 4, in <module>' in err, result
    assert "runpy" not in err and "distrun/_worker/main.py" not in err, result
    assert sorted(os.listdir(work)) == ["imports.py", "task.py"]  # a plain script: nothing


def test_a_nonfinite_loss_is_one_warning_line_at_its_first_step(tmp_path):
    work, result = _run(tmp_path, "run", "--nproc-per-node", "2", "--strategy", "ddp",
                        "--no-summary", "--batch-size", "16", "--max-epochs", "2",
                        "task.py:T", env={"NAN_LOSS": "1"})
    assert result.returncode == 0, result
    warnings = [ln for ln in _lines(result.output) if "nan" in ln and "warning" in ln]
    assert warnings == ["warning: the loss is nan at step 1 (epoch 0); training goes on (said "
                        "once; --nonfinite-loss stop ends the run at such a step)"], result


def test_nonfinite_loss_stop_ends_the_run_at_that_step(tmp_path):
    work, result = _run(tmp_path, "run", "--no-summary", "--batch-size", "16",
                        "--nonfinite-loss", "stop", "task.py:T", env={"NAN_LOSS": "1"})
    assert result.returncode == 1, result
    assert _lines(result.stderr) == ["error: rank 0: the loss is nan at step 1 (epoch 0); "
                                     "stopped there as --nonfinite-loss stop asks"], result
    assert not re.search(r"^epoch \d+ \| step", result.stdout, re.M)  # no step was logged


def test_a_rank_stuck_at_import_is_reported_as_that_not_as_uneven_inputs(tmp_path):
    work, result = _run(tmp_path, "run", "--nproc-per-node", "2", "--strategy", "ddp",
                        "--timeout", "3", "task.py:T", env={"STUCK_RANK": "1"})
    assert result.returncode == 1, result
    assert _lines(result.stderr) == [
        "error: rank 0: waited 3s for the other ranks before training started: a rank is stuck "
        "before training (at import, in setup or loading data) or never started; see the other "
        "ranks' output, or change the limit with --timeout SECONDS or DISTRUN_TIMEOUT"], result
    assert "uneven" not in result.output


# -- issue 26: one traceback, and the error quoted, whatever else a rank prints ---------------
FAILING = """
import atexit, os, sys
import torch
import torch.distributed as dist
import distrun

if os.environ.get("SAY_AT_EXIT"):
    atexit.register(print, "an unrelated line printed at exit")  # stdout, after the error


class T(distrun.Task):
    def configure_model(self):
        if os.environ.get("MODEL_RAISES"):
            if dist.is_initialized():
                dist.barrier()  # every rank raises, together
            raise ValueError("width 7 is not a power of two")
        return torch.nn.Linear(2, 1)

    def configure_optimizer(self, params):
        return None if os.environ.get("NO_OPTIMIZER") else torch.optim.SGD(params, lr=0.1)

    def train_data(self):
        return torch.utils.data.TensorDataset(torch.randn(16, 2), torch.randn(16, 1))

    test_data = train_data

    def training_step(self, model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    def test_step(self, model, batch):
        raise RuntimeError("test_step broke")
"""
USAGE_THEN_MORE = """
import atexit, sys
atexit.register(print, "an unrelated line printed at exit")
print("error: --widget 3 is not a widget (use 1 or 2)", file=sys.stderr, flush=True)
sys.exit(2)
"""


def _failing(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "failing.py").write_text(FAILING)
    (work / "usage.py").write_text(USAGE_THEN_MORE)
    return work, run_cli(*NO_BAR, "run", "--no-summary", *args, cwd=work,
                         env=env, timeout=120)


def test_configure_model_raising_on_every_rank_is_one_traceback_then_one_line(tmp_path):
    pytest.importorskip("distrun_ddp", reason="two ranks train with ddp")
    work, result = _failing(tmp_path, "--nproc-per-node", "2", "failing.py:T",
                            env={"MODEL_RAISES": "1"})
    assert result.returncode == 1, result
    err = result.stderr
    assert err.count("Traceback (most recent call last):") == 1, result
    assert _lines(err).count("ValueError: width 7 is not a power of two") == 1, result
    last = _lines(err)[-1]
    match = re.fullmatch(r"distrun: rank (\d) failed with exit code 1: ValueError: width 7 is "
                         r"not a power of two \(its output is above; rank (\d) failed the same "
                         r"way\)", last)
    assert match and {match[1], match[2]} == {"0", "1"}, result
    # each rank's log still has its own traceback
    logs = list((work / "runs").glob("*/logs/rank*.log"))
    assert len(logs) == 2 and all("Traceback" in p.read_text() for p in logs), logs


def test_a_failed_stage_is_quoted_not_a_line_printed_after_it(tmp_path):
    work, result = _failing(tmp_path, "--stage", "test", "failing.py:T",
                            env={"SAY_AT_EXIT": "1"})
    assert result.returncode == 1, result
    assert "an unrelated line printed at exit" in result.stdout, result
    assert _lines(result.stderr)[-1] == (
        "distrun: rank 0 failed with exit code 1: RuntimeError: test_step broke (its output is "
        "above)"), result


def test_a_usage_error_then_more_output_is_said_once_and_not_quoted(tmp_path):
    work, result = _failing(tmp_path, "usage.py")
    assert result.returncode == 2, result
    assert "an unrelated line printed at exit" in result.stdout, result
    assert _lines(result.stderr) == ["error: --widget 3 is not a widget (use 1 or 2)"], result


def test_configure_optimizer_returning_none_says_what_it_returned_and_must_return(tmp_path):
    work, result = _failing(tmp_path, "failing.py:T", env={"NO_OPTIMIZER": "1"})
    assert result.returncode == 2, result
    assert _lines(result.stderr) == [
        "error: T.configure_optimizer(params) returned None; it must return a "
        "torch.optim.Optimizer (e.g. `return torch.optim.AdamW(params, lr=1e-3)`) or "
        "{'optimizer': o, 'lr_scheduler': s}"], result
    assert "Traceback" not in result.output


TP_SCRIPT = """
import torch, distrun
from task import T

distrun.fit(T(), batch_size=16)
"""


def test_a_tp_size_a_worker_refuses_is_its_one_line_and_no_other(tmp_path):
    pytest.importorskip("distrun_tp", reason="--strategy tp")
    # A script's layout is known only in its workers: their line, and nothing quoted after it
    work = tmp_path / "work"
    work.mkdir()
    (work / "task.py").write_text(TASK)
    (work / "tp_script.py").write_text(TP_SCRIPT)
    result = run_cli(*NO_BAR, "run", "--nproc-per-node", "2", "--strategy", "tp",
                     "--tp-size", "3", "--no-summary", "tp_script.py", cwd=work, timeout=120)
    assert result.returncode == 2, result
    assert _lines(result.stderr) == [
        "error: --strategy tp splits layers over all 2 ranks but --tp-size is 3 (use "
        "--tp-size 2)"], result



def test_blocking_a_plugin_that_does_not_exist_warns_with_the_closest_name(cli, tmp_path):
    result = cli("-p", "no:consol", "plugins", cwd=tmp_path)
    assert result.returncode == 0, result  # as pytest: said, not fatal
    assert _lines(result.stderr) == [
        "warning: -p no:consol blocks nothing: no installed plugin is named 'consol' (did you "
        "mean 'console'? `distrun plugins` lists the names)"], result
    assert "console " in result.stdout  # nothing was blocked
    env = cli("plugins", cwd=tmp_path, env={"DISTRUN_BLOCK_PLUGINS": "xyzzy"})
    assert env.returncode == 0 and _lines(env.stderr) == [
        "warning: DISTRUN_BLOCK_PLUGINS=xyzzy blocks nothing: no installed plugin is named "
        "'xyzzy' (`distrun plugins` lists the names)"], env


RESUME_SCRIPT = """
import distrun
from task import T

distrun.fit(T(), batch_size=16)
"""


@pytest.mark.slow
def test_resume_that_no_plugin_reads_is_refused_by_a_script_s_workers(tmp_path):
    pytest.importorskip("distrun_safetensors", reason="the plugin -p no: blocks")
    # a script may register plugins in code: its workers check, after they did
    work = tmp_path / "work"
    (work / "ckpt").mkdir(parents=True)
    (work / "task.py").write_text(TASK)
    (work / "resume_script.py").write_text(RESUME_SCRIPT)
    result = run_cli("-p", "no:safetensors", *NO_BAR, "run", "--resume", "ckpt",
                     "resume_script.py", cwd=work, timeout=120)
    assert result.returncode == 2, result
    assert _lines(result.stderr) == [
        "error: --resume ckpt: no plugin reads it: 'safetensors', which implements "
        "distrun_load_checkpoint, is blocked (-p no:safetensors or DISTRUN_BLOCK_PLUGINS); "
        "unblock it, or drop --resume"], result


def test_a_run_the_launcher_refuses_leaves_no_run_folder(cli, tmp_path):
    # the port is found busy inside the launch, after the run folder used to be made
    import socket

    work = tmp_path / "work"
    work.mkdir()
    (work / "task.py").write_text(TASK)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = cli("run", "--master-port", str(port), "--name", "x", "task.py:T", cwd=work)
    assert result.returncode == 2, result
    assert _lines(result.stderr) == [
        f"error: port {port} on 127.0.0.1 is in use (pick another --master-port, or 0 for a "
        "free one)"], result
    assert sorted(os.listdir(work)) == ["task.py"], "the refused run left a folder"


def test_a_refused_launch_into_an_earlier_run_s_folder_leaves_it_as_it_was(cli, tmp_path):
    import socket

    work = tmp_path / "work"
    (work / "r").mkdir(parents=True)
    (work / "plain.py").write_text("print('hi')\n")
    (work / "r" / "config.toml").write_text("# the earlier run's\n")
    before = _tree(work)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = cli("run", "--nnodes", "2", "--node-rank", "0", "--master-port", str(port),
                     "--run-dir", "r", "plain.py", cwd=work)
    assert result.returncode == 2, result
    assert (work / "r" / "config.toml").read_text() == "# the earlier run's\n"
    assert sorted(_tree(work)) == sorted(before), "the refused run left something behind"


# -- issue 26: run options that would be lost, and more ranks than cores: a warning each -------
PLAIN = "import sys\nprint('argv', sys.argv[1:])\n"
FIT_SCRIPT = """
import argparse
import distrun
from task import T

parser = argparse.ArgumentParser()
parser.add_argument("--seed", type=int, default=0)  # the script's own: it passes it on
args, _ = parser.parse_known_args()
distrun.fit(T(), batch_size=16, seed=args.seed, summary=False)
"""


def _scripts(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "task.py").write_text(TASK)
    (work / "plain.py").write_text(PLAIN)
    (work / "fit_script.py").write_text(FIT_SCRIPT)
    return work


def test_launcher_options_after_a_script_are_one_warning_and_stay_the_script_s(tmp_path):
    work = _scripts(tmp_path)
    result = run_cli("run", "plain.py", "--nproc-per-node", "2", "--strategy=ddp", "--lr", "1",
                     "-r", "3", cwd=work, timeout=60)
    assert result.returncode == 0, result
    assert _lines(result.stderr) == [
        "warning: --nproc-per-node, --strategy after plain.py go to plain.py, which does not "
        "read them, not to distrun (put run options before the script: distrun run "
        "--nproc-per-node 2 --strategy=ddp plain.py)"], result
    # torchrun's rule: everything after the script is the script's, unchanged, on one worker
    assert _lines(result.stdout) == [
        "argv ['--nproc-per-node', '2', '--strategy=ddp', '--lr', '1', '-r', '3']"], result
    # options a script may well have of its own (--lr, --seed, -r) are not warned about
    quiet = run_cli("run", "plain.py", "--lr", "1", "--seed", "3", cwd=work, timeout=60)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet


# nanoGPT's configurator: `--key=value` overrides the global `key` the script names
CONFIGURATOR = """import sys
backend = 'nccl'
for arg in sys.argv[1:]:
    key, _, value = arg[2:].partition('=')
    if key in globals():
        globals()[key] = value
print('backend', backend)
"""
ARGPARSE = """import argparse
p = argparse.ArgumentParser()
p.add_argument('--nproc-per-node', type=int, default=1)
print('nproc', p.parse_args().nproc_per_node)
"""


@pytest.mark.parametrize(("script", "args", "out"), [
    (CONFIGURATOR, ["--backend=gloo"], "backend gloo"),
    (ARGPARSE, ["--nproc-per-node", "3"], "nproc 3"),
], ids=["configurator", "argparse"])
def test_a_launcher_option_the_script_reads_itself_is_not_warned_about(tmp_path, script, args,
                                                                       out):
    (tmp_path / "own.py").write_text(script)
    result = run_cli("run", "own.py", *args, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result
    assert _lines(result.stdout) == [out] and result.stderr == "", result


@pytest.mark.slow
def test_a_run_option_a_fit_script_did_not_pass_on_is_one_warning(tmp_path):
    work = _scripts(tmp_path)
    result = run_cli(*NO_BAR, "run", "fit_script.py", "--max-steps", "2", "--seed", "3",
                     cwd=work, timeout=120)
    assert result.returncode == 0, result
    assert _lines(result.stderr) == [
        "warning: fit_script.py was given --max-steps but did not pass it to "
        "distrun.fit/Trainer, so the run ignores it (put run options before the script: "
        "distrun run --max-steps 2 fit_script.py, or pass it in code)"], result


def test_more_ranks_than_cores_is_one_warning(tmp_path):
    work = _scripts(tmp_path)
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(affinity)})  # the launcher inherits one core
    try:
        result = run_cli("run", "--nproc-per-node", "2", "plain.py", cwd=work, timeout=60)
    finally:
        os.sched_setaffinity(0, affinity)
    assert result.returncode == 0, result
    assert _lines(result.stderr) == [
        "warning: 2 worker processes on 1 CPU core: they take turns on the cores, so each step "
        "is slower than with fewer ranks (--nproc-per-node 1 fits this machine)"], result
    assert _lines(result.stdout) == ["argv []", "argv []"], result
