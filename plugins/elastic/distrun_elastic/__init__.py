"""distrun-elastic: Elastic fault recovery for distrun."""
