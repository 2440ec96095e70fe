"""distrun-early-stopping: end a fit when a logged metric stops improving."""

from distrun_early_stopping.rule import MODES, EarlyStopping

__all__ = ["MODES", "EarlyStopping"]
