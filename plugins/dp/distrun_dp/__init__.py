"""distrun-dp: DataParallel strategy for distrun."""
