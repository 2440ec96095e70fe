"""distrun-join: Join for uneven inputs across ranks."""
