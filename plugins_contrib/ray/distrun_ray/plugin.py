"""Entry point of distrun-ray (imports neither torch nor ray): options and the launcher hook."""

from __future__ import annotations

from distrun.plugin import hookimpl
from distrun_ray.options import RayOptions

DISTRUN_PLUGIN_API = 1  # the distrun.plugin API this plugin is written for

PLUGIN = "ray"


@hookimpl
def distrun_register_options(register):
    register(RayOptions)


@hookimpl(tryfirst=True)
def distrun_launch(config, command, environ):
    if RayOptions.of(config).launcher != "ray":
        return None
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        from distrun.plugin import UsageError

        raise UsageError("--launcher ray needs Ray: pip install 'ray>=2.9'")
    from distrun_ray.launcher import launch_ray

    return launch_ray(config, command, environ)
