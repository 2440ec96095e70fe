"""Entry point of distrun-cluster-env (torch-free at import): detection and ``distrun submit``."""

from __future__ import annotations

from distrun.plugin import hookimpl

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for


@hookimpl
def distrun_detect_cluster(environ):
    from distrun_cluster_env.detect import detect

    return detect(environ)


@hookimpl
def distrun_add_commands(cli):
    from distrun_cluster_env.submit import submit_cmd

    cli.add_command(submit_cmd)
