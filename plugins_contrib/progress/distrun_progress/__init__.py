"""distrun-progress: Progress bar for distrun."""
