"""distrun-shm tests: build the extension once up front; /dev/shm is checked after each test."""

from __future__ import annotations

import pytest

pytest.importorskip("distrun_shm")


@pytest.fixture(scope="session", autouse=True)
def shm_built() -> None:
    from distrun_shm.build import load_extension, unavailable

    reason = unavailable()
    if reason:
        pytest.skip(f"the shm backend cannot run here: {reason}")
    load_extension()  # compile before any rank's timeout starts


@pytest.fixture(autouse=True)
def dev_shm_clean_after():
    yield
    from distrun_shm.backend import leftover_segments

    assert leftover_segments() == [], "segments left in /dev/shm"
