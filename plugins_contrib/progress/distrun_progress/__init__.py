"""distrun-progress: a progress bar (rich) on rank 0, plain lines when not on a terminal."""
