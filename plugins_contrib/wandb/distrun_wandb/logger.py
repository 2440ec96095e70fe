"""The W&B run of rank 0 (imports wandb, never torch).

``wandb.log`` hands each row to W&B's own service process (``wandb-core``), so the loop does
not wait on disk or network. That process exits with the worker (it watches its parent's
pid); ``finish`` flushes it. A W&B failure is a warning: a lost metric must not cost a run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

from distrun.plugin import first_line
from distrun_wandb.options import WandbOptions

__all__ = ["RUN_FILE", "WandbLogger", "mode_of", "open_logger", "render_plot"]

log = logging.getLogger("distrun")

#: in the run folder: the W&B run id this folder writes to, so a resume continues that run
RUN_FILE = "wandb_run.json"
#: the key of the end-of-run plot in the run's history and media
PLOT_KEY = "metrics_plot"


def mode_of(opts: WandbOptions) -> str:
    """``--wandb-mode`` when ``--wandb`` is on (else ``disabled``); ``auto`` is
    ``$WANDB_MODE`` when the user set one, else offline."""
    if not opts.wandb:
        return "disabled"
    mode = opts.wandb_mode
    if mode == "auto":
        mode = os.environ.get("WANDB_MODE", "").strip() or "offline"
    return str(mode)


def _init_kwargs(run: Any, mode: str) -> dict[str, Any]:
    cfg = run.config
    opts = WandbOptions.of(cfg)
    name = cfg.name or None
    config = cfg.as_dict()
    config["distrun"] = {"world_size": run.world_size,
                         "strategy": getattr(run.strategy, "name", None),
                         "resumed_from": run.resumed_from}
    kwargs: dict[str, Any] = dict(
        project=opts.wandb_project or os.environ.get("WANDB_PROJECT") or "distrun",
        entity=opts.wandb_entity or None,  # None: wandb reads $WANDB_ENTITY
        name=opts.wandb_run_name or name,
        tags=[t.strip() for t in opts.wandb_tags.split(",") if t.strip()] or None,
        config=config,
        job_type=getattr(run, "stage", "fit"),
        mode=mode,
        # a W&B run the user's own script opened stays open and untouched
        reinit="create_new",
    )
    if not any(var in os.environ for var in ("WANDB_QUIET", "WANDB_SILENT")):
        import wandb

        # W&B's own lines go to stderr, ahead of distrun's one-line errors, and its closing
        # summary repeats the console line: one line of ours says where the run is instead.
        kwargs["settings"] = wandb.Settings(silent=True)
    if run.run_dir:
        os.makedirs(run.run_dir, exist_ok=True)
        kwargs["dir"] = os.path.abspath(run.run_dir)
        saved = _read_id(os.path.join(run.run_dir, RUN_FILE))
        if saved:
            kwargs.update(id=saved, resume="allow")
    return kwargs


def _read_id(path: str) -> str | None:
    try:
        with open(path) as fh:
            return str(json.load(fh)["id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def open_logger(run: Any) -> WandbLogger | bool:
    """Start (or continue) the W&B run; False, with a warning, when W&B cannot start."""
    mode = mode_of(WandbOptions.of(run.config))
    try:
        import wandb

        wb_run = wandb.init(**_init_kwargs(run, mode))
    except Exception as exc:
        hint = " (`wandb login`, or --wandb-mode offline)" if mode == "online" else ""
        log.warning("warning: distrun-wandb: W&B did not start in %s mode (%s); this run is "
                    "not logged to W&B%s", mode, _line(exc), hint)
        return False
    if run.run_dir:
        _write_json(os.path.join(run.run_dir, RUN_FILE),
                    {"id": wb_run.id, "project": wb_run.project, "mode": mode,
                     "dir": getattr(wb_run, "dir", None)})
    _say_where(wb_run, mode)
    return WandbLogger(wb_run)


def _say_where(wb_run: Any, mode: str) -> None:
    """One line on rank 0: the run's page, or the offline folder and how to upload it."""
    try:
        url = wb_run.url if mode == "online" else None
        folder = os.path.dirname(wb_run.dir) if getattr(wb_run, "dir", None) else None
    except Exception:
        return
    if url:
        log.info("W&B run %s: %s", wb_run.id, url)
    elif folder and mode == "offline":
        log.info("W&B offline run in %s (`wandb sync` it to upload)", os.path.relpath(folder))


class WandbLogger:
    """Rows to ``run.log(..., step=step)``; ``exit_code`` is set by the failure hooks."""

    def __init__(self, wb_run: Any) -> None:
        self.run = wb_run
        self.exit_code = 0
        self.last_step = 0
        self.finished = False
        self._failures = 0

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        try:
            self.run.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
            self.last_step = max(self.last_step, step)
        except Exception as exc:
            self._failures += 1
            if self._failures == 1:
                log.warning("warning: distrun-wandb: logging failed (%s); training goes on",
                            _line(exc))

    def preempted(self, exit_code: int) -> None:
        self.exit_code = exit_code
        try:
            self.run.mark_preempting()  # W&B shows the run as preempted, not crashed
        except Exception:
            pass

    def close(self, run: Any, plot: bool = True) -> None:
        """The plot (``plot``, after a fit), then ``finish(exit_code=...)``; never raises."""
        if self.finished:
            return
        self.finished = True
        path = None
        try:
            if plot and getattr(run, "stage", "fit") == "fit" \
                    and WandbOptions.of(run.config).wandb_log_plot:
                path = render_plot(run)
            if path:
                import wandb

                step = max(self.last_step, run.progress.step)
                self.run.log({PLOT_KEY: wandb.Image(path, caption="distrun plot")}, step=step)
        except Exception as exc:
            log.warning("warning: distrun-wandb: no plot logged (%s)", _line(exc))
        try:
            self.run.finish(exit_code=self.exit_code)
        except Exception as exc:
            log.warning("warning: distrun-wandb: finishing the W&B run failed (%s)", _line(exc))
        finally:
            if path:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def render_plot(run: Any) -> str | None:
    """The run's curves as an image in a temporary folder (see ``distrun.plugin.plot_run``)."""
    from distrun.plugin import plot_run

    return plot_run(run, "distrun-wandb")


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)


def _line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc, 300)}"
