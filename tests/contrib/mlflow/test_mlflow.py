"""distrun-mlflow: real 2-rank runs logged to local MLflow stores, read back with MlflowClient."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrun._launch.lifeline import die_with_parent
from distrun._loggers.csv_file import read_metrics
from distrun.testing import run_cli

pytest.importorskip("mlflow", reason="distrun-mlflow needs mlflow-skinny")

TASK = str(Path(__file__).resolve().parents[2] / "core" / "tiny_task.py")
#: two ranks over DDP, a log row every 2 steps; other loggers blocked to keep runs short
COMMON = ("--nproc-per-node", "2", "--strategy", "ddp", "--batch-size", "32",
          "--log-every-n-steps", "2", "--no-summary", "-p", "no:wandb", "-p", "no:tensorboard",
          "-p", "no:progress")


def _local_env(mp: pytest.MonkeyPatch) -> None:
    """No tracking server and the plugin's defaults: a suite may turn it off by environment."""
    for name in [n for n in os.environ if n.startswith("DISTRUN_MLFLOW")]:
        mp.delenv(name)
    mp.setenv("DISTRUN_MLFLOW", "1")  # the plugin is off unless asked for: --mlflow
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this process's reader


@pytest.fixture(autouse=True)
def _local_only(monkeypatch):
    _local_env(monkeypatch)


def client_for(run_dir: Path):
    """MLflow's own client on the store the run folder names, and the run id."""
    from mlflow import MlflowClient

    saved = json.loads((run_dir / "mlflow_run.json").read_text())
    return MlflowClient(tracking_uri=saved["tracking_uri"]), saved["run_id"]


def history(client, run_id: str, key: str) -> dict[int, float]:
    """step -> value; for a step logged twice (a resume replays it) the latest value."""
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return {m.step: m.value for m in points}


def csv_column(run_dir: Path, key: str) -> dict[int, float]:
    return {int(r["step"]): r[key] for r in read_metrics(str(run_dir / "metrics.csv"))
            if key in r}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        _local_env(mp)
        result = run_cli("run", *COMMON, "--name", "fit", "--max-epochs", "2",
                         "--mlflow-tags", "team=nlp, owner=ana", TASK, cwd=tmp)
    assert result.returncode == 0, result
    return tmp / "runs" / "fit"


def test_metrics_params_status_and_plot_read_back_with_mlflow(finished):
    client, run_id = client_for(finished)
    assert client.tracking_uri == (finished / "mlruns").as_uri()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "fit"
    assert client.get_experiment(run.info.experiment_id).name == "fit"
    # 256 samples / 32 = 8 steps an epoch, 2 epochs, a row every 2 steps: the same numbers as
    # the core's metrics.csv, step by step (the CSV keeps 8 significant digits).
    loss = history(client, run_id, "loss")
    assert list(loss) == [2, 4, 6, 8, 10, 12, 14, 16]
    expected = csv_column(finished, "loss")
    assert loss == {step: pytest.approx(value, rel=1e-7) for step, value in expected.items()}
    assert list(history(client, run_id, "val_loss")) == [8, 16]
    assert list(history(client, run_id, "lr").values()) == [pytest.approx(0.05)] * 8
    assert "step" not in run.data.metrics  # the step is the x axis, not a metric
    params = run.data.params
    assert params["strategy"] == "ddp"
    assert params["max_epochs"] == "2" and params["batch_size"] == "32"
    assert params["mlflow_tags"] == "team=nlp, owner=ana"
    assert len(params) > 100  # the whole config, in more than one batch of 100
    tags = run.data.tags
    assert tags["team"] == "nlp" and tags["owner"] == "ana"
    assert tags["distrun.strategy"] == "ddp" and tags["distrun.world_size"] == "2"
    assert [a.path for a in client.list_artifacts(run_id)] == ["metrics.png"]
    png = Path(client.download_artifacts(run_id, "metrics.png", str(finished.parent)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_only_rank_0_writes(finished):
    # one run in one experiment (plus MLflow's empty Default); rank 1 opened nothing
    client, run_id = client_for(finished)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [run_id]


def test_plugin_module_imports_neither_torch_nor_mlflow():
    code = ("import sys, distrun_mlflow.plugin; "
            "print(sorted(m for m in ('torch', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("flags, says", [
    (("--mlflow-tags", "team"), "invalid value for --mlflow-tags: 'team' is not KEY=VALUE"),
    (("--mlflow-tags", "=x"), "invalid value for --mlflow-tags: '=x' is not KEY=VALUE"),
])
def test_bad_tags_are_a_usage_error(cli, tmp_path, flags, says):
    result = cli("run", *flags, f"{TASK}:TinyTask", cwd=tmp_path)
    assert result.returncode == 2, result
    assert says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*noload.*:DeprecationWarning")  # MLflow's, on SQLAlchemy 2.1
def test_sqlite_store_experiment_run_name_and_off(tmp_path):
    pytest.importorskip("sqlalchemy", reason="sqlite:/// needs distrun-mlflow[sqlite]")
    pytest.importorskip("alembic", reason="sqlite:/// needs distrun-mlflow[sqlite]")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = run_cli("run", *COMMON, "--name", "sq", "--max-steps", "4",
                     "--mlflow-tracking-uri", uri, "--mlflow-experiment", "tiny-exp",
                     "--mlflow-run-name", "first try", TASK, cwd=tmp_path)
    assert result.returncode == 0, result
    run_dir = tmp_path / "runs" / "sq"
    assert not (run_dir / "mlruns").exists()
    client, run_id = client_for(run_dir)
    assert client.tracking_uri == uri
    run = client.get_run(run_id)
    assert (run.info.status, run.info.run_name) == ("FINISHED", "first try")
    assert client.get_experiment(run.info.experiment_id).name == "tiny-exp"
    assert history(client, run_id, "loss") == {
        step: pytest.approx(value, rel=1e-7) for step, value in csv_column(run_dir, "loss").items()}

    off = run_cli("run", *COMMON, "--name", "off", "--max-steps", "2", "--no-mlflow", TASK,
                  cwd=tmp_path)
    assert off.returncode == 0, off
    assert not (tmp_path / "runs" / "off" / "mlruns").exists()
    assert not (tmp_path / "runs" / "off" / "mlflow_run.json").exists()


@pytest.mark.slow
def test_a_failing_run_ends_failed_with_what_it_logged(tmp_path):
    # Both ranks raise in training_step at micro-step 13, in the second epoch: the first
    # epoch's rows are logged (its validation flushed them), later ones as the ranks agreed.
    result = run_cli("run", *COMMON, "--name", "bad", "--max-epochs", "2", TASK,
                     cwd=tmp_path, env={"TINY_RAISE_AT": "13"})
    assert result.returncode != 0, result
    assert "boom at micro-step 13" in result.output
    run_dir = tmp_path / "runs" / "bad"
    client, run_id = client_for(run_dir)
    assert client.get_run(run_id).info.status == "FAILED"
    loss = history(client, run_id, "loss")
    assert {2, 4, 6, 8} <= set(loss) and max(loss) < 13
    assert loss == {step: pytest.approx(value, rel=1e-7)
                    for step, value in csv_column(run_dir, "loss").items()}
    assert list(history(client, run_id, "val_loss")) == [8]
    assert client.list_artifacts(run_id) == []  # no plot after a failure: the status first


def preempt_after_rows(tmp_path: Path, name: str, rows: int, *flags: str) -> str:
    """Start a long run, SIGTERM the launcher (as a scheduler does) once metrics.csv has
    ``rows`` loss rows; the launcher's output."""
    cmd = [sys.executable, "-m", "distrun", "run", *COMMON, "--name", name,
           "--max-epochs", "1000", *flags, TASK]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent())
    csv_path = tmp_path / "runs" / name / "metrics.csv"
    try:
        deadline = time.monotonic() + 120
        while not (csv_path.exists() and len(read_metrics(str(csv_path))) >= rows):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no metrics rows within 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 143, out
    return out


@pytest.mark.slow
def test_a_preempted_run_ends_killed(tmp_path):
    preempt_after_rows(tmp_path, "pre", 3)
    run_dir = tmp_path / "runs" / "pre"
    client, run_id = client_for(run_dir)
    assert client.get_run(run_id).info.status == "KILLED"
    loss = history(client, run_id, "loss")
    assert len(loss) >= 3 and loss == {step: pytest.approx(value, rel=1e-7)
                                       for step, value in csv_column(run_dir, "loss").items()}
    assert [a.path for a in client.list_artifacts(run_id)] == ["metrics.png"]


@pytest.mark.slow
def test_resume_continues_the_same_mlflow_run(tmp_path):
    pytest.importorskip("distrun_safetensors", reason="resuming needs a checkpoint plugin")
    # no end checkpoint: the resume starts behind the last logged step, as after a crash
    first = run_cli("run", *COMMON, "--name", "r", "--max-steps", "8",
                    "--ckpt-every-n-steps", "3", "--no-ckpt-save-on-end", TASK, cwd=tmp_path)
    assert first.returncode == 0, first
    run_dir = tmp_path / "runs" / "r"
    client, run_id = client_for(run_dir)
    assert client.get_run(run_id).data.params["max_steps"] == "8"
    second = run_cli("run", *COMMON, "--name", "r", "--max-steps", "12", "--resume", "auto",
                     TASK, cwd=tmp_path)
    assert second.returncode == 0, second
    assert client_for(run_dir)[1] == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    # MLflow params never change: the first value stays, the resumed one is a tag.
    assert run.data.params["max_steps"] == "8"
    assert run.data.tags["distrun.resumed.max_steps"] == "12"
    assert run.data.tags["distrun.resumed_from"].endswith("step-6")
    # Resumed at step 6: steps 7-8 ran twice and MLflow keeps both values; the latest of each
    # step is the resumed run's, which metrics.csv holds too.
    points = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in points) == [2, 4, 6, 8, 8, 10, 12]
    assert history(client, run_id, "loss") == {
        step: pytest.approx(value, rel=1e-7) for step, value in csv_column(run_dir, "loss").items()}


def test_flatten_and_keys():
    from distrun_mlflow.settings import flatten, metric_key, parse_tags

    assert flatten({"a": 1, "b": {"c": [1, 2], "d": None}}) == {"a": "1", "b.c": "1,2",
                                                                "b.d": "None"}
    assert metric_key("val_acc@top1") == "val_acc_top1"
    assert metric_key("/abs") == "_abs" and metric_key("a/../b") == "a____b"
    assert len(metric_key("x" * 300)) == 250
    assert parse_tags(" a=1 ,b = two=2,") == {"a": "1", "b": "two=2"}
    with pytest.raises(ValueError):
        parse_tags("a=1,b")
