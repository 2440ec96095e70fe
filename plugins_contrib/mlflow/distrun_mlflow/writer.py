"""The MLflow run of rank 0, written by a background thread that owns the ``MlflowClient``.

The loop only queues. Opening the store (importing mlflow, creating an SQLite schema, a server
round trip) starts while the rest of setup runs, and each write happens off the training
thread: everything queued since the last write goes out in one ``log_batch``. A store that
fails is a warning and training goes on: a lost metric must not cost a run.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distrun.plugin import first_line
from distrun_mlflow.options import MlflowOptions
from distrun_mlflow.settings import (
    MAX_KEY,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VALUE,
    MAX_PARAMS_PER_BATCH,
    MAX_TAG_VALUE,
    flatten,
    is_file_store,
    metric_key,
    parse_tags,
    tracking_uri,
    truncate,
)

__all__ = ["RUN_FILE", "MlflowWriter", "Settings", "close_run", "render_plot", "settings_of"]

log = logging.getLogger("distrun")

#: in the run folder: which MLflow run this folder writes to, so a resume continues it
RUN_FILE = "mlflow_run.json"
#: seconds the loop waits for the store to open before training starts
OPEN_TIMEOUT = 60.0
#: seconds a failing or preempted rank waits for its status to be written (the launcher
#: gives a rank whose peer failed a few seconds before it kills it)
END_TIMEOUT = 3.0
#: seconds teardown waits for the queue to drain (a server may retry for a while)
CLOSE_TIMEOUT = 120.0


@dataclass
class Settings:
    """What the thread needs to open the run, taken from the run config."""

    uri: str
    experiment: str
    run_name: str
    params: dict[str, str]
    tags: dict[str, str]
    run_file: str | None = None


def settings_of(run: Any) -> Settings:
    cfg = run.config
    opts = MlflowOptions.of(cfg)
    name = cfg.name or os.path.basename(os.path.normpath(run.run_dir or "run"))
    tags = parse_tags(opts.mlflow_tags)
    tags.update({"distrun.world_size": str(run.world_size),
                 "distrun.strategy": str(getattr(run.strategy, "name", "")),
                 "distrun.stage": getattr(run, "stage", "fit")})
    if run.run_dir:
        tags["distrun.run_dir"] = os.path.abspath(run.run_dir)
    return Settings(
        uri=tracking_uri(opts.mlflow_tracking_uri, run.run_dir),
        experiment=opts.mlflow_experiment or name,
        run_name=opts.mlflow_run_name or name,
        params=flatten(cfg.as_dict()),
        tags=tags,
        run_file=os.path.join(run.run_dir, RUN_FILE) if run.run_dir else None,
    )


class MlflowWriter:
    """Queue rows from the loop; a thread writes them. The hooks set ``status``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.status = "FINISHED"
        #: the loop raised: teardown ends the thread without the plot (the launcher may be
        #: stopping this rank because another one failed)
        self.failed = False
        self.run_id: str | None = None
        self.opened = threading.Event()
        self._ended = False
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._failures = 0
        self._client: Any = None  # the thread's, once the store is open
        self._thread = threading.Thread(target=self._work, name="distrun-mlflow", daemon=True)
        self._thread.start()

    # -- the training thread ---------------------------------------------------------------
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._queue.put(("metrics", step, int(time.time() * 1000), dict(metrics)))

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self._queue.put(("tags", dict(tags)))

    def wait_open(self) -> None:
        if not self.opened.wait(OPEN_TIMEOUT):
            log.warning("warning: distrun-mlflow: the MLflow store at %s is not open after %gs; "
                        "training starts, the rows wait in memory", self.settings.uri,
                        OPEN_TIMEOUT)

    def end(self, status: str, timeout: float = END_TIMEOUT) -> None:
        """Write the rows queued so far and the run's final status, waiting up to
        ``timeout`` seconds. Later artifacts may still be logged to the ended run."""
        if self._ended:
            return
        self._ended = True
        self.status = status
        done = threading.Event()
        self._queue.put(("end", status, done))
        done.wait(timeout)

    def close(self, artifacts: list[str]) -> bool:
        """End the run (unless ended), log ``artifacts``, stop; False when the store hung."""
        self.end(self.status, timeout=0)
        for path in artifacts:
            self._queue.put(("artifact", path))
        self._queue.put(("stop",))
        self._thread.join(CLOSE_TIMEOUT)
        if self._thread.is_alive():
            log.warning("warning: distrun-mlflow: the MLflow store at %s did not take the last "
                        "writes within %gs", self.settings.uri, CLOSE_TIMEOUT)
            return False
        return True

    # -- the writer thread -----------------------------------------------------------------
    def _work(self) -> None:
        try:
            self._client = self._open()
        except Exception as exc:  # the store is unusable: say so once, keep training
            log.warning("warning: distrun-mlflow: could not open an MLflow run at %s (%s); "
                        "this run is not logged to MLflow", self.settings.uri, _line(exc))
        finally:
            self.opened.set()
        while True:
            items = [self._queue.get()]
            while True:  # everything queued meanwhile goes out together
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            rows: list[tuple[Any, ...]] = []
            for item in items:
                if item[0] == "metrics":
                    rows.append(item)
                    continue
                self._do(self._send, rows)
                rows = []
                kind = item[0]
                if kind == "tags":
                    self._do(self._tags, item[1])
                elif kind == "end":
                    self._do(lambda status: self._client.set_terminated(self.run_id, status),
                             item[1])
                    item[2].set()
                elif kind == "artifact":
                    self._do(lambda path: self._client.log_artifact(self.run_id, path), item[1])
                elif kind == "stop":
                    if self._failures:
                        log.warning("warning: distrun-mlflow: %d write(s) to %s failed",
                                    self._failures, self.settings.uri)
                    return
            self._do(self._send, rows)

    def _do(self, fn: Any, *args: Any) -> None:
        if self._client is None:
            return
        try:
            fn(*args)
        except Exception as exc:
            self._failures += 1
            if self._failures == 1:
                log.warning("warning: distrun-mlflow: writing to %s failed (%s); training goes "
                            "on", self.settings.uri, _line(exc))

    def _open(self) -> Any:
        s = self.settings
        if is_file_store(s.uri):
            # MLflow 3 keeps the file store in maintenance mode and refuses it unless asked.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        client = MlflowClient(tracking_uri=s.uri)
        self.run_id = self._continued(client)
        logged: dict[str, str] = {}
        tags = dict(s.tags)
        if self.run_id is None:
            run = client.create_run(_experiment(client, s.experiment), run_name=s.run_name)
            self.run_id = run.info.run_id
            _write_json(s.run_file, {"tracking_uri": s.uri, "run_id": self.run_id,
                                     "experiment_id": run.info.experiment_id})
        else:
            client.update_run(self.run_id, status="RUNNING")
            logged = client.get_run(self.run_id).data.params
        params = {truncate(k, MAX_KEY): truncate(v, MAX_PARAM_VALUE) for k, v in s.params.items()}
        # MLflow params never change: a continued run keeps the first values, and the new
        # values of changed options go into tags.
        for key, value in params.items():
            if key in logged and logged[key] != value:
                tags[f"distrun.resumed.{key}"] = value
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), MAX_PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=new[i:i + MAX_PARAMS_PER_BATCH])
        self._tags(tags, client)
        return client

    def _tags(self, tags: Mapping[str, str], client: Any = None) -> None:
        from mlflow.entities import RunTag

        client = client or self._client
        items = [RunTag(truncate(k, MAX_KEY), truncate(str(v), MAX_TAG_VALUE))
                 for k, v in tags.items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            client.log_batch(self.run_id, tags=items[i:i + MAX_PARAMS_PER_BATCH])

    def _continued(self, client: Any) -> str | None:
        """The run id this run folder logged to before, when that run is still there."""
        path = self.settings.run_file
        if not path or not os.path.exists(path):
            return None
        try:
            with open(path) as fh:
                saved = json.load(fh)
            if saved.get("tracking_uri") != self.settings.uri:
                log.info("distrun-mlflow: this run folder logged to %s before; a new MLflow "
                         "run starts at %s", saved.get("tracking_uri"), self.settings.uri)
                return None
            run = client.get_run(saved["run_id"])
        except Exception as exc:
            log.warning("warning: distrun-mlflow: cannot continue the MLflow run named in %s "
                        "(%s); a new one starts", path, _line(exc))
            return None
        if run.info.lifecycle_stage == "deleted":
            return None
        return str(run.info.run_id)

    def _send(self, rows: list[tuple[Any, ...]]) -> None:
        if not rows:
            return
        from mlflow.entities import Metric

        metrics = [Metric(metric_key(name), float(value), stamp, step)
                   for _, step, stamp, values in rows
                   for name, value in values.items() if name != "step"]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])


def _experiment(client: Any, name: str) -> str:
    """The id of experiment ``name``, made (or restored from deletion) if need be."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return str(client.create_experiment(name))
        except MlflowException:  # another run made it in the meantime
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if found.lifecycle_stage == "deleted":
        client.restore_experiment(found.experiment_id)
    return str(found.experiment_id)


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)


def _line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc, 300)}"


def render_plot(run: Any) -> str | None:
    """The run's curves as an image in a temporary folder (see ``distrun.plugin.plot_run``)."""
    from distrun.plugin import plot_run

    return plot_run(run, "distrun-mlflow")


def close_run(run: Any, writer: MlflowWriter) -> None:
    """At teardown: the status (unless a failure hook wrote it), the plot after a fit that
    did not fail, the end of the thread. Never raises."""
    writer.end(writer.status, timeout=0)  # the status first: the plot may take a second
    plot = None
    if getattr(run, "stage", "fit") == "fit" and not writer.failed \
            and MlflowOptions.of(run.config).mlflow_log_plot:
        try:
            plot = render_plot(run)
        except Exception as exc:
            log.warning("warning: distrun-mlflow: no plot logged (%s)", _line(exc))
    if writer.close([plot] if plot else []) and plot:
        shutil.rmtree(os.path.dirname(plot), ignore_errors=True)
