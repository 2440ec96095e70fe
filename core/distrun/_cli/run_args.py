"""``distrun run``'s command line as torchrun spells it, read before click parses it.

Torch-free. Options after a Task target are run options; after a script they are the script's,
and one that only a launcher reads (``--nproc-per-node``, ``--strategy``...) is said in a
warning: the script would never see it as its own, and distrun does not see it.
"""

from __future__ import annotations

import os
import re
import sys

import click

__all__ = ["UNSUPPORTED_TORCHRUN", "RunCommand", "is_task_target"]


#: torchrun flags distrun does not carry out, and why (said in one line, exit 2)
UNSUPPORTED_TORCHRUN = {
    "--logs-specs": "custom LogsSpecs classes are torch's agent's; distrun relays output itself "
                    "(use --log-dir, --redirects, --local-ranks-filter)",
    "--event-log-handler": "torch's event log handlers are not wired into distrun's launcher",
    "--numa-binding": "NUMA binding is not supported (bind with numactl around `distrun run`)",
    "--virtual-local-rank": "every worker sees its own LOCAL_RANK (no virtual local rank)",
    "--duplicate-stdout-filters": "output filters are not supported (filter with grep)",
    "--duplicate-stderr-filters": "output filters are not supported (filter with grep)",
    "--shutdown-timeout": "the stop grace is fixed at 30 s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT "
                          "sets it under distrun-elastic)",
}
#: torchrun's stream choices for --tee N / -t N (distrun's --tee is a switch)
_STD_VALUE = re.compile(r"^[0-3]$|^[0-9]+:[0-3](,[0-9]+:[0-3])*$")


def is_task_target(target: str, as_module: bool = False) -> bool:
    """``pkg.module:Task`` or ``file.py:Task`` (not a script path, not ``-m``)."""
    return not as_module and ":" in target and not target.endswith(".py") \
        and not os.path.isfile(target)


def _source_of(target: str, as_module: bool) -> str:
    """The source text of the script or module ``target`` ("" when it cannot be read without
    importing anything)."""
    path: str | None = target
    if as_module:
        path = _module_file(target)
    try:
        with open(path or "", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def _module_file(name: str) -> str | None:
    """The file ``python -m name`` would run, found without importing its packages."""
    from importlib.machinery import PathFinder

    search: list[str] | None = [os.getcwd(), *sys.path[1:]]
    spec = None
    for part in name.split("."):
        spec = PathFinder.find_spec(part, search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    if spec is None or spec.origin is None:
        return None
    if spec.submodule_search_locations:  # a package: its __main__
        main = os.path.join(os.path.dirname(spec.origin), "__main__.py")
        return main if os.path.isfile(main) else None
    return spec.origin


def _reads_flag(source: str, flag: str) -> bool:
    """Whether a script's source names ``flag`` (``--backend``: ``backend``, ``"--backend"``):
    an argparse option of its own, or a configurator that reads ``--key=value`` into the
    variable ``key``. A short flag (``-r``) is always taken to be the script's."""
    if not flag.startswith("--"):
        return True
    if not source:
        return True  # a module that cannot be read without importing it: not warned about
    words = re.split(r"[-_]", flag[2:])
    pattern = r"(?<![\w-])" + r"[-_]".join(map(re.escape, words)) + r"(?![\w])"
    return re.search(pattern, source) is not None


class RunCommand(click.Command):
    """``distrun run``: torchrun's spellings are read here, before click parses.

    - ``--tee N`` / ``-t N`` with torchrun's values becomes distrun's ``--tee`` switch (N > 0)
      or ``--no-tee`` (0); ``--tee`` alone stays the switch;
    - options after a Task target (``train.py:Task --max-epochs 5``) are run options, as if
      they came before it; after a script or ``-m MODULE`` they stay the script's, and the
      launcher-only ones among them (:attr:`launcher_only`) are said in one warning.
    """

    #: the long flags of options only a launcher reads (``Option.launcher_only``)
    launcher_only: frozenset[str] = frozenset()

    def _warn_launcher_options(self, target: str, rest: list[str],
                               takes_value: dict[str, bool], as_module: bool) -> None:
        """One warning for launcher-only options after a script that the script does not
        read: they reach neither it nor distrun. One its source names (nanoGPT's
        ``--backend=gloo``, an argparse flag of its own) is the script's, and not said."""
        given: list[str] = []
        source: str | None = None
        i = 0
        while i < len(rest) and rest[i] != "--":
            arg = rest[i]
            name = arg.split("=", 1)[0]
            if name in self.launcher_only:
                has_value = "=" not in arg and takes_value.get(name) and i + 1 < len(rest)
                if source is None:
                    source = _source_of(target, as_module)
                if not _reads_flag(source, name):
                    given.append(f"{arg} {rest[i + 1]}" if has_value else arg)
                i += 2 if has_value else 1
                continue
            i += 1
        if not given:
            return
        names = ", ".join(g.split(" ")[0].split("=")[0] for g in given)
        verb, them = ("goes", "it") if len(given) == 1 else ("go", "them")
        sys.stderr.write(
            f"warning: {names} after {target} {verb} to {target}, which does not read {them}, "
            f"not to distrun (put run options before the script: distrun run "
            f"{' '.join(given)} {target})\n"
        )

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        takes_value = {}
        for param in self.params:
            if isinstance(param, click.Option):
                for name in (*param.opts, *param.secondary_opts):
                    takes_value[name] = not param.is_flag
        out: list[str] = []
        i, as_module = 0, False
        while i < len(args):
            arg = args[i]
            name = arg.split("=", 1)[0]
            nxt = args[i + 1] if i + 1 < len(args) else None
            if arg == "--":
                out.extend(args[i:])
                return super().parse_args(ctx, out)
            if name in UNSUPPORTED_TORCHRUN or name.replace("_", "-") in UNSUPPORTED_TORCHRUN:
                flag = name.replace("_", "-")
                raise click.UsageError(f"torchrun's {flag} is not supported by distrun: "
                                       f"{UNSUPPORTED_TORCHRUN[flag]}", ctx)
            if name in ("--tee", "-t"):
                value = arg.partition("=")[2] if "=" in arg else None
                if value is None and nxt is not None and _STD_VALUE.match(nxt):
                    value, i = nxt, i + 1
                if value is not None and not _STD_VALUE.match(value):
                    raise click.UsageError(
                        f"invalid value for --tee: {value!r} (torchrun's values: 0-3 or "
                        "LOCAL_RANK:N,...; or --tee alone to prefix each line with its rank)",
                        ctx)
                on = value is None or any(p.rsplit(":", 1)[-1] != "0" for p in value.split(","))
                out.append("--tee" if on else "--no-tee")
                i += 1
                continue
            if arg.startswith("-") and arg != "-":
                if name in ("-m", "--module"):
                    as_module = True
                out.append(arg)
                if "=" not in arg and takes_value.get(name) and nxt is not None:
                    out.append(nxt)
                    i += 1
                i += 1
                continue
            # the target: what follows is the script's, unless the target is a Task
            rest = args[i + 1:]
            if is_task_target(arg, as_module) and rest and rest[0] != "--":
                out.extend([*rest, arg])
            else:
                self._warn_launcher_options(arg, rest, takes_value, as_module)
                out.extend([arg, *rest])
            return super().parse_args(ctx, out)
        return super().parse_args(ctx, out)
