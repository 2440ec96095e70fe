"""distrun-amp: Mixed precision for distrun."""
