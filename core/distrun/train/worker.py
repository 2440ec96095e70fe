"""``python -m distrun.train.worker TARGET [ARGS]``: the worker entry point for task targets."""

from __future__ import annotations

import sys

from distrun.spec.errors import DistrunError


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m distrun.train.worker pkg.module:Task [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    target, args = argv[0], argv[1:]
    sys.argv = [target, *args]
    try:
        from distrun.train.task import load_task

        task = load_task(target)
    except DistrunError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None
    from distrun.train.trainer import Trainer

    Trainer().fit(task)


if __name__ == "__main__":
    main()
