"""The pluggy markers, bound to the project name ``distrun``."""

import pluggy

PROJECT = "distrun"
ENTRY_POINT_GROUP = "distrun"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
