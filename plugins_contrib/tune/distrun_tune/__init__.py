"""distrun-tune: an LR range test and a batch-size finder, run on the run's own strategy."""
