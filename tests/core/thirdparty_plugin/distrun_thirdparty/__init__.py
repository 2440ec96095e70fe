"""distrun-thirdparty: a plugin written against distrun.plugin only (a test of that API)."""
