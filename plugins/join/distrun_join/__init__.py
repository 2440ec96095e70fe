"""distrun-join: uneven inputs across ranks finish instead of hanging."""

__all__ = ["MODES"]

from distrun_join.options import MODES
