"""Entry point of distrun-elastic (torch-free at import): torchrun's options and the launch.

The launch hook answers only when the config asks for elasticity (see
:func:`distrun_elastic.settings.wants_elastic`); otherwise the core's local launcher runs.
"""

from __future__ import annotations

from distrun.plugin import hookimpl, plugin_options

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

PLUGIN = "elastic"


@hookimpl
def distrun_register_options(register):
    # Names mirror torchrun's flags (no plugin prefix); torchrun's spellings are aliases.
    # Only the launcher reads them: after a script, they are warned about.
    opt = plugin_options(register, PLUGIN, launcher_only=True)
    opt("max_restarts", int, 0,
        "restart all workers up to N times after a failure, from the latest checkpoint",
        min=0, aliases=("--max_restarts",))
    opt("rdzv_backend", str, "c10d", "torch rendezvous backend",
        choices=("c10d", "static", "etcd", "etcd-v2"), aliases=("--rdzv_backend",))
    opt("rdzv_endpoint", str, "", "rendezvous address, the same on every node (default: "
        "127.0.0.1 and a free port on one node)", metavar="HOST:PORT",
        aliases=("--rdzv_endpoint",))
    opt("rdzv_id", str, "", "rendezvous id shared by the nodes of one job (also names the run)",
        metavar="ID", aliases=("--rdzv_id",))
    opt("rdzv_conf", str, "", "extra rendezvous settings, e.g. last_call_timeout=5,"
        "join_timeout=600", metavar="K=V,...", aliases=("--rdzv_conf",))
    opt("heartbeat_timeout", float, 15.0,
        "seconds without a heartbeat from another node's agent before the others re-form "
        "without it (a host that is down, frozen or cut off); --timeout still bounds a "
        "collective that is merely slow", min=1.0, metavar="SECONDS")
    opt("warm_restart", bool, True,
        "fork every start of a worker, restarts included, from a per-rank spare that has "
        "imported torch already (--no-warm-restart: each start is a new interpreter)")
    opt("monitor_interval", float, 0.1, "how often the agent checks on the workers", min=0.01,
        metavar="SECONDS", aliases=("--monitor_interval",))


@hookimpl(tryfirst=True)
def distrun_launch(config, command, environ):
    from distrun_elastic.settings import make_plan, wants_elastic

    if not wants_elastic(config):
        return None
    plan, config = make_plan(config, environ)
    from distrun.plugin import warn_oversubscribed
    from distrun_elastic.agent import launch_elastic

    warn_oversubscribed(plan.nproc_per_node)

    return launch_elastic(plan, command, environ)
