"""What ``distrun run`` checks before any worker starts, torch-free, each in one line.

A worker takes seconds to start (torch's import, the process group), so what the launcher can
know is said there: a script that does not compile, and for a Task target (whose run config
is final in the launcher: no code can change it) a strategy layout that cannot be built, a
global batch that does not divide over the data-parallel ranks, and a stage whose step method
the task lacks. The workers check the same again, with the same words.
"""

from __future__ import annotations

import ast
import os
import sys

from distrun._config.parallel_dims import check_global_batch
from distrun._config.run_config import RunConfig
from distrun._spec.errors import UsageError
from distrun._spec.strategy import StrategyInfo

__all__ = ["check_layout", "check_stages", "check_syntax", "task_source"]

#: per stage: the step method a task must define for it (the workers say the same)
STAGE_STEPS = {"test": ("test_step", "test_step(model, batch); define it (it returns the loss "
                                     "or a dict of metrics)")}


def check_syntax(path: str) -> None:
    """A script that does not compile is said in one line before any worker starts."""
    try:
        with open(path, "rb") as fh:
            source = fh.read()
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        text = (exc.text or "").strip()
        where = f"{path}:{exc.lineno}" if exc.lineno else path
        raise UsageError(f"{where}: {exc.msg}" + (f": {text}" if text else "") +
                         " (fix the script; no worker was started)") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None


def check_layout(config: RunConfig, info: StrategyInfo, world_size: int) -> None:
    """The strategy's layout of ``world_size`` ranks, and the global batch over its
    data-parallel ranks (when the strategy declares its layout)."""
    dp = info.data_parallel_size(config, world_size)
    if dp is not None:
        check_global_batch(config.batch_size, dp)


def check_degrees(config: RunConfig) -> None:
    """The parallel degrees the plugins publish (``distrun_parallel_degrees``), asked once per
    launch: whole numbers >= 1 (the strategy that builds the mesh checks they fit the world)."""
    for name, degree in config.parallel_degrees().items():
        if degree < 1:
            raise UsageError(f"the {name} degree must be at least 1, not {degree} (a plugin "
                             f"published it: check the option that sets the {name} degree)")


def check_stages(config: RunConfig, target: str) -> None:
    """A stage whose step method the Task class of ``target`` certainly lacks."""
    for stage in config.stage.split(","):
        if stage not in STAGE_STEPS:
            continue
        method, usage = STAGE_STEPS[stage]
        name = task_lacks(target, method)
        if name is not None:
            raise UsageError(f"--stage {stage}: {name} has no {usage}")


def task_source(target: str) -> str | None:
    """The file that defines ``target``'s module (``file.py:Task`` or ``pkg.mod:Task``),
    found without importing anything; None when it is not a plain source file."""
    where = target.rpartition(":")[0]
    if where.endswith(".py"):
        return where if os.path.isfile(where) else None
    parts = where.split(".")
    if not all(p.isidentifier() for p in parts):
        return None
    for root in (os.getcwd(), *sys.path):
        base = os.path.join(root or os.curdir, *parts)
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


def task_lacks(target: str, method: str) -> str | None:
    """The class name when the Task class ``target`` names certainly has no ``method``.

    Certain means: the class is defined at the top of its file, without decorators or a
    metaclass, its bases are ``distrun.Task`` (which has no such method) or classes of the same
    file, and the method's name appears nowhere in that file. Anything else is for the workers
    to find.
    """
    path, attr = task_source(target), target.rpartition(":")[2]
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        tree = ast.parse(source, path)
    except (OSError, ValueError, SyntaxError):
        return None
    if method in source or "__getattr__" in source:
        return None
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    distrun_names = _distrun_task_names(tree)
    seen: set[str] = set()

    def plain(name: str) -> bool:
        node = classes.get(name)
        if node is None or name in seen or node.decorator_list or node.keywords:
            return False
        seen.add(name)
        return all(_base_name(b, distrun_names) in ("Task", "object") or
                   (isinstance(b, ast.Name) and plain(b.id)) for b in node.bases)

    return attr if plain(attr) else None


def _distrun_task_names(tree: ast.Module) -> dict[str, str]:
    """Local names bound to distrun (``import distrun as d``) or to ``distrun.Task``."""
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "distrun":
                    names[alias.asname or "distrun"] = "distrun"
        elif isinstance(node, ast.ImportFrom) and node.module == "distrun" and not node.level:
            for alias in node.names:
                if alias.name == "Task":
                    names[alias.asname or "Task"] = "Task"
    return names


def _base_name(base: ast.expr, names: dict[str, str]) -> str | None:
    """``"Task"`` for distrun's Task class, ``"object"`` for object, else None."""
    if isinstance(base, ast.Name):
        if base.id == "object":
            return "object"
        return "Task" if names.get(base.id) == "Task" else None
    if isinstance(base, ast.Attribute) and base.attr == "Task" and \
            isinstance(base.value, ast.Name) and names.get(base.value.id) == "distrun":
        return "Task"
    return None
