"""distrun-lr-monitor: each param group's learning rate (and momentum) in the logged metrics."""
