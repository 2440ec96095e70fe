"""What the MLflow run is made of, from the run config (imports neither torch nor mlflow)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import posixpath
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["check_tracking_uri", "flatten", "is_file_store", "metric_key", "parse_tags",
           "tracking_uri"]

#: MLflow's limits (mlflow.utils.validation): a store rejects a request over them
MAX_KEY = 250
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000

#: tracking URI schemes MLflow serves through SQLAlchemy (``sqlite``, ``postgresql+psycopg2``)
_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
_BAD_CHARS = re.compile(r"[^\w./\- :]")


def parse_tags(value: str) -> dict[str, str]:
    """``team=nlp,owner=ana`` as a dict; ValueError (said after the value) when malformed."""
    tags: dict[str, str] = {}
    for part in value.split(","):
        if not part.strip():
            continue
        key, sep, val = part.partition("=")
        if not sep or not key.strip():
            raise ValueError("is not KEY=VALUE pairs separated by commas "
                             "(e.g. --mlflow-tags team=nlp,owner=ana)")
        tags[key.strip()] = val.strip()
    return tags


def check_tracking_uri(value: str) -> str:
    """The URI unchanged; a database URI without SQLAlchemy installed is refused up front."""
    value = value.strip()
    scheme = value.split(":", 1)[0].split("+", 1)[0].lower() if ":" in value else ""
    if scheme in _DB_SCHEMES and not (importlib.util.find_spec("sqlalchemy")
                                      and importlib.util.find_spec("alembic")):
        raise ValueError("needs SQLAlchemy and Alembic, which mlflow-skinny leaves out: "
                         "pip install 'distrun-mlflow[sqlite]'")
    return value


def tracking_uri(given: str, run_dir: str | None) -> str:
    """``given`` (``--mlflow-tracking-uri``), else ``$MLFLOW_TRACKING_URI``, else
    ``file:RUN_DIR/mlruns``."""
    uri = given or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri:
        return uri
    return pathlib.Path(os.path.abspath(os.path.join(run_dir or ".", "mlruns"))).as_uri()


def is_file_store(uri: str) -> bool:
    """A local folder (``file:...`` or a plain path): MLflow's file store."""
    from urllib.parse import urlparse

    scheme = urlparse(uri).scheme
    return scheme == "file" or scheme == "" and uri not in ("databricks", "databricks-uc", "uc")


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings as dotted keys, every value as a string (MLflow params are strings)."""
    out: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            out[name] = ",".join(map(str, value))
        else:
            out[name] = str(value)
    return out


def metric_key(name: str) -> str:
    """``name`` as a key MLflow accepts: its characters, at most 250, no path tricks."""
    key = _BAD_CHARS.sub("_", name)[:MAX_KEY]
    if not key or posixpath.normpath(key) != key or key.startswith(("/", "..")):
        key = key.replace("/", "_").replace(".", "_") or "_"
    return key


def truncate(value: str, limit: int) -> str:
    """At most ``limit`` characters; a cut value ends in "..." so it reads as cut."""
    return value if len(value) <= limit else value[:limit - 3] + "..."
