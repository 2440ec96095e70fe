"""Entry point of distrun-elastic (torch-free at import): torchrun's options and the launch.

The launch hook answers only when the config asks for elasticity (see
:func:`distrun_elastic.settings.wants_elastic`); otherwise the core's local launcher runs.
"""

from __future__ import annotations

from distrun.plugin import hookimpl
from distrun_elastic.options import ElasticOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

PLUGIN = "elastic"


@hookimpl
def distrun_register_options(register):
    register(ElasticOptions)


@hookimpl
def distrun_continues_run(config):
    # every start of a restarting run resumes from its folder's checkpoints
    return ElasticOptions.of(config).max_restarts > 0 or None


@hookimpl(tryfirst=True)
def distrun_launch(config, command, environ):
    from distrun_elastic.settings import make_plan, wants_elastic

    if not wants_elastic(config):
        return None
    plan, config = make_plan(config, environ)
    from distrun_elastic.launch import launch_elastic

    # (the worker group warns once when this node's ranks outnumber its cores)
    return launch_elastic(plan, command, environ, services=config.node_services())
