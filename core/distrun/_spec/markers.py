"""The pluggy markers, bound to the project name ``distrun``, and the plugin API's version."""

import pluggy

PROJECT = "distrun"
ENTRY_POINT_GROUP = "distrun"

#: the version of the plugin API (:mod:`distrun.plugin`); a plugin module states the one it
#: was written for as ``DISTRUN_PLUGIN_API = N``; raise it only when a plugin must change
API_VERSION = 1
#: the module attribute where a plugin states the API version it targets
API_ATTRIBUTE = "DISTRUN_PLUGIN_API"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
