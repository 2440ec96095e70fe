"""distrun-shm: a shared-memory CPU process-group backend (``--backend shm``)."""

__all__: list[str] = []
