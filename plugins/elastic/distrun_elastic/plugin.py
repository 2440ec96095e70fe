"""Entry point of distrun-elastic (torch-free at import): torchrun's options and the launch.

The launch hook answers only when the config asks for elasticity (see
:func:`distrun_elastic.settings.wants_elastic`); otherwise the core's local launcher runs.
"""

from __future__ import annotations

from distrun import Option, hookimpl

PLUGIN = "elastic"


@hookimpl
def distrun_register_options(register):
    # Names mirror torchrun's flags (no plugin prefix); torchrun's spellings are aliases.
    register(Option(
        name="max_restarts", type=int, default=0, min=0, aliases=("--max_restarts",),
        help="restart all workers up to N times after a failure, from the latest checkpoint",
        plugin=PLUGIN, launcher_only=True,
    ))
    register(Option(
        name="rdzv_backend", type=str, default="c10d", aliases=("--rdzv_backend",),
        choices=("c10d", "static", "etcd", "etcd-v2"),
        help="torch rendezvous backend", plugin=PLUGIN, launcher_only=True,
    ))
    register(Option(
        name="rdzv_endpoint", type=str, default="", aliases=("--rdzv_endpoint",),
        metavar="HOST:PORT", plugin=PLUGIN, launcher_only=True,
        help="rendezvous address, the same on every node (default: 127.0.0.1 and a free port "
             "on one node)",
    ))
    register(Option(
        name="rdzv_id", type=str, default="", aliases=("--rdzv_id",), metavar="ID",
        help="rendezvous id shared by the nodes of one job (also names the run)",
        plugin=PLUGIN, launcher_only=True,
    ))
    register(Option(
        name="rdzv_conf", type=str, default="", aliases=("--rdzv_conf",), metavar="K=V,...",
        help="extra rendezvous settings, e.g. last_call_timeout=5,join_timeout=600",
        plugin=PLUGIN, launcher_only=True,
    ))
    register(Option(
        name="monitor_interval", type=float, default=0.1, min=0.01,
        aliases=("--monitor_interval",), metavar="SECONDS", plugin=PLUGIN, launcher_only=True,
        help="how often the agent checks on the workers",
    ))


@hookimpl(tryfirst=True)
def distrun_launch(config, command, environ):
    from distrun_elastic.settings import make_plan, wants_elastic

    if not wants_elastic(config):
        return None
    plan, config = make_plan(config, environ)
    from distrun_elastic.agent import launch_elastic

    return launch_elastic(plan, command, environ)
