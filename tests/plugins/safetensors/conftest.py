"""Make the helper modules of this folder (st_layouts, st_plugin, st_task) importable, also in
spawned ranks, under pytest's importlib import mode."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
