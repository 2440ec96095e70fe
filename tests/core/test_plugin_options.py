"""Typed plugin options: one frozen dataclass per plugin declares the options (flag, variable,
TOML key) and reads them back typed, each default written once; the config itself has no
attribute per plugin option, and a strategy reads another plugin's parallel degree as a
published fact (``distrun_parallel_degrees``), never as that plugin's option."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass

import pluggy
import pytest

from distrun._config.run_config import resolve_config
from distrun._registry.collect import collect_options
from distrun._registry.manager import make_plugin_manager
from distrun._spec.options import Option, plugin_options  # the older forms, kept working
from distrun.plugin import PluginOptions, UsageError, hookimpl, option


@dataclass(frozen=True)
class DemoOptions(PluginOptions, plugin="demo"):
    demo_level: int = option(3, "how loud", min=0)
    demo_ratio: float = option(0.5, "a share", max=1)
    demo_mode: str = option("soft", "how", choices=("soft", "hard"))
    demo_on: bool = option(False, "switch it on")
    demo_limit: float | None = option(None, "unset: no limit")


class DemoPlugin:
    @hookimpl
    def distrun_register_options(self, register):
        register(DemoOptions)


class OldStylePlugin:
    """The form plugins used before PluginOptions: still declares and reads."""

    @hookimpl
    def distrun_register_options(self, register):
        opt = plugin_options(register, "old")
        opt("old_count", int, 7, "a count", min=1)


class TensorDegree:
    """Publishes a tp degree without being the tp plugin (the fact, not an option name)."""

    @hookimpl
    def distrun_parallel_degrees(self, config):
        return {"tp": 2}


def _manager(*plugins: object) -> pluggy.PluginManager:
    pm = make_plugin_manager(autoload=False)
    for plugin in plugins:
        pm.register(plugin)
    return pm


def _config(pm: pluggy.PluginManager, **kw):
    kw.setdefault("environ", {})
    return resolve_config(collect_options(pm), pluginmanager=pm, **kw)


def test_one_class_declares_flags_with_their_types_and_reads_them_typed(tmp_path):
    pm = _manager(DemoPlugin())
    declared = {o.name: o for o in collect_options(pm)}
    assert (declared["demo_level"].type, declared["demo_level"].default) == (int, 3)
    assert declared["demo_limit"].type is float and declared["demo_limit"].default is None
    assert declared["demo_on"].flag == "--demo-on" and declared["demo_mode"].plugin == "demo"
    toml = tmp_path / "run.toml"
    toml.write_text("[demo]\nratio = 0.25\n")
    config = _config(pm, flags={"demo_level": "5", "demo_on": "yes"}, config_file=str(toml),
                     environ={"DISTRUN_DEMO_LIMIT": "2.5"})
    opts = DemoOptions.of(config)
    assert opts == DemoOptions(demo_level=5, demo_ratio=0.25, demo_on=True, demo_limit=2.5)
    assert opts is config.options(DemoOptions)  # built once per config
    with pytest.raises(FrozenInstanceError):
        opts.demo_level = 1  # type: ignore[misc]


def test_declared_bounds_and_choices_are_checked():
    pm = _manager(DemoPlugin())
    with pytest.raises(UsageError, match="--demo-ratio: 2.0 is above the maximum 1"):
        _config(pm, flags={"demo_ratio": "2"})
    with pytest.raises(UsageError, match="Allowed: soft, hard"):
        _config(pm, flags={"demo_mode": "loud"})


def test_the_config_has_no_attribute_per_plugin_option():
    config = _config(_manager(DemoPlugin()), flags={"demo_level": "4"})
    assert not hasattr(config, "demo_level")
    assert config.get("demo_level") == 4 and config.get("max_epochs") == 1


def test_defaults_come_from_the_class_when_the_config_lacks_the_plugin():
    config = _config(_manager())
    assert DemoOptions.of(config) == DemoOptions()
    assert DemoOptions.of(config).demo_level == 3


def test_the_older_declaration_form_still_declares_and_reads():
    pm = _manager(OldStylePlugin())
    assert _config(pm).get("old_count") == 7
    assert _config(pm, flags={"old_count": "9"}).get("old_count") == 9


def test_a_class_that_is_not_a_frozen_dataclass_is_a_plugin_bug():
    class Loose(PluginOptions, plugin="loose"):
        loose_x: int = 1

    @dataclass
    class Thawed(PluginOptions, plugin="thawed"):
        thawed_x: int = option(1, "x")

    @dataclass(frozen=True)
    class Odd(PluginOptions, plugin="odd"):
        odd_x: list = option((), "x")

    for cls, match in ((Loose, "must be decorated with @dataclass"),
                       (Thawed, "must be decorated with @dataclass"),
                       (Odd, "annotate it as bool, int, float or str")):
        with pytest.raises(TypeError, match=match):
            cls.declarations()


def test_a_name_two_classes_declare_is_refused():
    @dataclass(frozen=True)
    class Clash(PluginOptions, plugin="clash"):
        demo_level: int = option(1, "x")

    class ClashPlugin:
        @hookimpl
        def distrun_register_options(self, register):
            register(Clash)

    with pytest.raises(UsageError, match="option 'demo_level' is declared twice"):
        collect_options(_manager(DemoPlugin(), ClashPlugin()))


def test_a_published_parallel_degree_reaches_a_strategy_that_composes_with_it():
    pm = _manager(TensorDegree())
    assert _config(pm).parallel_degrees() == {"tp": 2}
    assert _config(_manager()).parallel_degrees() == {}
    with pytest.raises(UsageError, match="parallel degree 'tp' is published by two plugins"):
        _config(_manager(TensorDegree(), TensorDegree())).parallel_degrees()


def test_a_plain_option_declaration_still_registers():
    class Plain:
        @hookimpl
        def distrun_register_options(self, register):
            register(Option("plain_x", int, 1, plugin="plain"))

    assert _config(_manager(Plain())).get("plain_x") == 1


def test_the_launcher_refuses_a_published_degree_below_one():
    from distrun._cli.run_checks import check_degrees

    class Zero:
        @hookimpl
        def distrun_parallel_degrees(self, config):
            return {"tp": 0}

    check_degrees(_config(_manager(TensorDegree())))
    with pytest.raises(UsageError, match="the tp degree must be at least 1, not 0"):
        check_degrees(_config(_manager(Zero())))
