"""distrun-notebook: run a function or a distrun Task on N forked local processes from a cell.

Importing it does not import torch.
"""

from distrun_notebook.launcher import FitResult, notebook_launcher
from distrun_notebook.workers import LaunchFailed

__all__ = ["FitResult", "LaunchFailed", "notebook_launcher"]
