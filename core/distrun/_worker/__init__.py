"""The worker process: its entry point, its warm spare, the store rank 0 serves."""
