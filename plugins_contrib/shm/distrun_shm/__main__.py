"""``python -m distrun_shm``: build (or find) the extension now and say where it is."""

from __future__ import annotations

import sys


def main() -> int:
    from distrun_shm import build

    reason = build.unavailable()
    if reason is not None and build.built_library() is None and "build failed" not in reason:
        print(f"distrun-shm: cannot build here: {reason}", file=sys.stderr)
        return 1
    try:
        build.load_extension()
    except build.BuildError as exc:
        print(f"distrun-shm: {exc}", file=sys.stderr)
        return 1
    print(f"distrun-shm: ready ({build.built_library()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
