"""``distrun env``: a block to paste into a bug report (imports torch, unlike the rest of the CLI)."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

from distrun._registry.collect import collect_backends
from distrun._registry.manager import plugin_infos
from distrun._version import __version__

__all__ = ["env_report"]


def _backend_lines(pm: Any) -> list[str]:
    """One line per offered backend: available here or why not, its devices and its plugin."""
    backends = collect_backends(pm)
    width = max((len(n) for n in backends), default=4)
    out = []
    for name, info in sorted(backends.items()):
        reason = info.unavailable()
        state = "available" if reason is None else f"unavailable: {reason}"
        out.append(f"    {name:<{width}}  {state}  [{', '.join(info.devices)}; {info.plugin}]")
    return out


def env_report(pm: Any) -> str:
    lines = [
        f"- distrun version: {__version__}",
        f"- Platform: {platform.platform()}",
        f"- Python version: {sys.version.split()[0]}",
    ]
    try:
        import torch

        lines += [
            f"- PyTorch version: {torch.__version__}",
            f"- CUDA available: {torch.cuda.is_available()}"
            + (f" ({torch.version.cuda})" if torch.version.cuda else ""),
            f"- GPU count: {torch.cuda.device_count()}",
            "- Backends (--backend NAME):",
            *_backend_lines(pm),
        ]
    except ImportError:
        lines.append("- PyTorch version: not installed (pip install torch)")
    lines.append(f"- CPU count: {os.cpu_count()}")
    cluster = pm.hook.distrun_detect_cluster(environ=dict(os.environ))
    if cluster is not None:
        facts = ", ".join(f"{k}={v}" for k, v in cluster.__dict__.items()
                          if v is not None and v is not False and k != "name")
        lines.append(f"- Cluster environment: {cluster.name}" + (f" ({facts})" if facts else ""))
    lines.append("- Plugins:")
    for info in plugin_infos(pm):
        origin = "built-in" if info.builtin else info.distribution
        lines.append(f"    {info.name} {info.version} ({origin})")
    return "\n".join(lines)
