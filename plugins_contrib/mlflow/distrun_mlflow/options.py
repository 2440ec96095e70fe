"""The mlflow plugin's options, read typed with ``MlflowOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


def _tags(value: str) -> str:
    """Check ``KEY=VALUE,KEY=VALUE`` (the launcher rejects a bad value with exit 2)."""
    from distrun_mlflow.settings import parse_tags

    parse_tags(value)
    return value.strip()


def _uri(value: str) -> str:
    from distrun_mlflow.settings import check_tracking_uri

    return check_tracking_uri(value)


@dataclass(frozen=True)
class MlflowOptions(PluginOptions, plugin="mlflow"):
    """The mlflow plugin's options (``MlflowOptions.of(config)``)."""

    mlflow: bool = option(
        False, "log params, metrics, the loss plot and the status to MLflow on rank 0")
    mlflow_tracking_uri: str = option(
        "", "where to log: a local store such as sqlite:///mlflow.db, or a server (default: "
        "$MLFLOW_TRACKING_URI, else the file store RUN_DIR/mlruns)",
        parse=_uri, metavar="URI")
    mlflow_experiment: str = option("", "experiment name (default: the run name)")
    mlflow_run_name: str = option("", "MLflow run name (default: the run name)")
    mlflow_tags: str = option(
        "", "tags of the MLflow run, e.g. team=nlp,owner=ana",
        parse=_tags, metavar="KEY=VALUE,...")
    mlflow_log_plot: bool = option(
        True, "log the loss/lr/throughput plot of metrics.csv as metrics.png at the end (needs "
        "matplotlib)")
