"""Run options a script was given but did not pass on to the run, said once (torch-free).

``distrun run train.py --max-steps 5`` hands ``--max-steps 5`` to the script, as torchrun
would. A script that trains with ``distrun.fit``/``Trainer`` but does not pass the value on
trains with the default: rank 0 says so once, naming the options and the command that fixes
it. An option whose value reached the run (from code, a flag before the script, a variable, a
file) is not named.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from distrun._config.run_config import RunConfig

__all__ = ["warn_unread_argv"]

_WARNED = False


def warn_unread_argv(config: RunConfig, options: list[Any]) -> None:
    """Run options in the script's own arguments that did not reach the run: said once.

    ``distrun run train.py --max-steps 5`` hands ``--max-steps 5`` to the script; a script
    that does not pass it on to ``fit``/``Trainer`` trains with the default. Launcher-only
    options are the launcher's to warn about.
    """
    global _WARNED
    if _WARNED:
        return
    flags: dict[str, Any] = {}
    for opt in options:
        if opt.launcher_only:
            continue
        for name in (opt.flag, *opt.aliases):
            if name.startswith("--"):
                flags[name] = opt
                if opt.type is bool:
                    flags["--no-" + name[2:]] = opt
    args, given = sys.argv[1:], []
    for i, arg in enumerate(args):
        if arg == "--":
            break
        opt = flags.get(arg.split("=", 1)[0])
        if opt is None or opt.name in config.sources:
            continue  # not a run option, or the script passed it on (or it came from elsewhere)
        value = i + 1 < len(args) and "=" not in arg and opt.type is not bool
        given.append(f"{arg} {args[i + 1]}" if value else arg)
    if not given:
        return
    _WARNED = True
    script = os.path.basename(sys.argv[0] or "the script")
    names = ", ".join(g.split(" ")[0].split("=")[0] for g in given)
    them = "it" if len(given) == 1 else "them"
    print(f"warning: {script} was given {names} but did not pass {them} to distrun.fit/Trainer, "
          f"so the run ignores {them} (put run options before the script: distrun run "
          f"{' '.join(given)} {script}, or pass {them} in code)", file=sys.stderr, flush=True)
