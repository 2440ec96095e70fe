"""Run every benchmark in this folder (``tox -e bench``); each prints its own ratios.

    python benchmarks/run_all.py            # all, default sizes
    python benchmarks/run_all.py --quick    # all, small sizes
    python benchmarks/run_all.py step_overhead checkpoint   # some
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    flags = [a for a in argv if a.startswith("-")]
    names = [a for a in argv if not a.startswith("-")]
    scripts = sorted(p for p in HERE.glob("*.py") if p.name != Path(__file__).name
                     and not p.name.startswith("_"))
    if names:
        scripts = [p for p in scripts if p.stem in names]
    failed = []
    for script in scripts:
        print(f"\n=== {script.stem} ===", flush=True)
        code = subprocess.call([sys.executable, str(script), *flags])
        if code:
            failed.append(script.stem)
    if failed:
        print(f"\nbenchmarks that failed to run: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
