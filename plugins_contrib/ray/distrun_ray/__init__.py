"""distrun-ray: Ray launcher for distrun."""
