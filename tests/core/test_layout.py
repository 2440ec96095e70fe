"""The package layout holds: no module of distrun or its plugins imports itself back."""

from __future__ import annotations

import pytest

grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (requirements-dev)")

PACKAGES = [
    "distrun", "distrun_ddp", "distrun_dp", "distrun_elastic", "distrun_fsdp", "distrun_join",
    "distrun_rpc", "distrun_safetensors", "distrun_tp", "distrun_amp", "distrun_cluster_env",
    "distrun_progress", "distrun_tensorboard", "distrun_zero", "distrun_early_stopping",
    "distrun_lr_monitor", "distrun_profiler", "distrun_mlflow", "distrun_wandb",
    "distrun_notebook", "distrun_pipeline", "distrun_shm", "distrun_ray", "distrun_torchx",
    "distrun_ft", "distrun_deepspeed",
]


def _installed(names: list[str]) -> list[str]:
    import importlib.util

    return [n for n in names if importlib.util.find_spec(n) is not None]


def test_no_import_cycles_even_through_type_checking_imports():
    graph = grimp.build_graph(*_installed(PACKAGES), exclude_type_checking_imports=False,
                              cache_dir=None)
    cycles = []
    for module in sorted(graph.modules):
        for other in graph.find_modules_directly_imported_by(module):
            if other.startswith(module + ".") or module.startswith(other + "."):
                continue  # a package and its own submodule
            back = graph.find_shortest_chain(importer=other, imported=module)
            if back is not None and module < other:
                cycles.append(" -> ".join([module, *back]))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
