"""distrun-early-stopping: end a fit when a logged metric stops improving.

``EarlyStopping`` is the rule and a callback object (``Trainer(callbacks=[...])``) in one; the
flags (``--early-stop-monitor`` ...) make one for the run.
"""

from distrun_early_stopping.callback import EarlyStopping
from distrun_early_stopping.rule import MODES

__all__ = ["MODES", "EarlyStopping"]
