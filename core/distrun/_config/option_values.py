"""The parsers of core option values that a plain type does not check (``--nproc-per-node``,
``--redirects``, ``--local-ranks-filter``, ``--signals-to-handle``, ``--name``, ``--stage``,
``--backend``), and the words they accept; :mod:`distrun._config.run_config` declares the
options with them. Each raises ValueError saying what is wrong with the value.
"""

from __future__ import annotations

import re

__all__ = ["DEFAULT_SIGNALS", "NPROC_WORDS", "STAGES"]

#: torchrun's ``--nproc-per-node`` words: a device count, this machine's CPUs, or either
NPROC_WORDS = ("auto", "cpu", "gpu")
#: the signals torchrun's agent handles (exported as TORCHELASTIC_SIGNALS_TO_HANDLE)
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
_STD = re.compile(r"^[0-3]$|^[0-9]+:[0-3](,[0-9]+:[0-3])*$")


def _nproc(value: str) -> int | str:
    if value in NPROC_WORDS:
        return value
    try:
        n = int(value)
    except ValueError:
        raise ValueError("is not a number of processes (use N >= 1, cpu, gpu or auto)") from None
    if n < 1:
        raise ValueError("is too few: start at least 1 process (or use cpu, gpu or auto)")
    return n


def _std(value: str) -> str:
    """torchrun's ``--redirects``/``--tee`` value: 0-3, or LOCAL_RANK:N,... per rank."""
    value = value.strip()
    if not _STD.match(value):
        raise ValueError("is not a torchrun stream choice (0 none, 1 stdout, 2 stderr, 3 both; "
                         "or per local rank, e.g. 0:3,1:0)")
    return value


def _ranks_filter(value: str) -> str:
    value = value.strip()
    if not value:
        return ""  # every rank
    try:
        ranks = [int(r) for r in value.split(",")]
    except ValueError:
        raise ValueError("is not a comma-separated list of local ranks (e.g. 0 or 0,1)") from None
    if any(r < 0 for r in ranks):
        raise ValueError("names a negative local rank")
    return ",".join(map(str, ranks))


def _signals(value: str) -> str:
    import signal

    names = [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if not isinstance(getattr(signal, n, None), signal.Signals)]
    if bad or not names:
        raise ValueError(f"names no signal{'s' if len(bad) > 1 else ''} {', '.join(bad)} "
                         f"(use names such as {DEFAULT_SIGNALS})")
    return ",".join(names)


def _run_name(value: str) -> str:
    if "/" in value or "\\" in value or value in (".", "..") or ".." in value:
        raise ValueError("must be a plain folder name: no '/', '\\' or '..' (use --run-dir "
                         "PATH to put the run folder elsewhere)")
    return value


#: what ``--stage`` accepts, in a comma-separated list run in order
STAGES = ("fit", "validate", "test", "predict")


def _stages(value: str) -> str:
    names = [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in STAGES]
    if bad or not names:
        raise ValueError(f"names no stage {', '.join(bad)!s} (use {', '.join(STAGES)}, or "
                         "several in order: fit,test)")
    return ",".join(names)


def _backend(value: str) -> str:
    from distrun._spec.backends import parse_backend

    parse_backend(value)  # the ValueError says what is wrong
    return value.strip().lower() or "auto"
