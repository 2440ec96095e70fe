"""The core names no plugin: ``--resume`` words beyond never/auto/latest come from the plugins
that read them (``distrun_resume_words``), and ``--strategy auto`` picks among the strategies
that offer themselves for it (``StrategyInfo.auto_priority``), not a name the core knows."""

from __future__ import annotations

import pluggy
import pytest

from distrun._config.run_config import resolve_config
from distrun._registry.collect import choose_strategy, collect_options, collect_strategies
from distrun._registry.manager import make_plugin_manager
from distrun.plugin import StrategyInfo, UsageError, hookimpl


class HourlyCheckpoints:
    @hookimpl
    def distrun_resume_words(self):
        return {"hourly": "the newest hourly checkpoint"}


class Preferred:
    """A multi-process strategy that asks --strategy auto for more than anyone else."""

    @hookimpl
    def distrun_register_strategies(self, register):
        register(StrategyInfo("mine", "builtins:object", plugin="mine", auto_priority=1000))
        register(StrategyInfo("never_auto", "builtins:object", plugin="mine"))


def _manager(*plugins: object, blocked: tuple[str, ...] = ()) -> pluggy.PluginManager:
    pm = make_plugin_manager(autoload=False, blocked=blocked)
    for plugin in plugins:
        pm.register(plugin)
    return pm


def _resolve(pm: pluggy.PluginManager, **flags: str):
    return resolve_config(collect_options(pm), flags=flags, environ={}, pluginmanager=pm)


def test_a_resume_word_comes_from_the_plugin_that_names_it():
    pm = _manager(HourlyCheckpoints())
    assert _resolve(pm, resume="hourly").resume == "hourly"
    resume = next(o for o in collect_options(pm) if o.name == "resume")
    assert "'hourly': the newest hourly checkpoint" in resume.help


def test_best_is_not_a_core_word():
    # without a plugin that names it, `best` is a path like any other word
    with pytest.raises(UsageError, match=r"--resume best: no such checkpoint \(use 'auto', "
                                         r"'latest', 'never' or an existing path\)"):
        _resolve(_manager(), resume="best")


def test_two_plugins_naming_one_word_is_a_plugin_bug():
    with pytest.raises(UsageError, match="--resume word 'hourly' is named by two plugins"):
        _resolve(_manager(HourlyCheckpoints(), HourlyCheckpoints()))


def test_auto_picks_the_strategy_that_offers_itself_most():
    pm = _manager(Preferred())
    strategies = collect_strategies(pm)
    config = _resolve(pm)
    assert choose_strategy(config, 4, strategies).name == "mine"
    assert choose_strategy(config, None, strategies).name == "mine"
    assert choose_strategy(config, 1, strategies).name == "single"


def test_auto_without_a_strategy_that_offers_itself_says_so():
    pm = _manager(blocked=("ddp",))
    strategies = {n: s for n, s in collect_strategies(pm).items() if s.auto_priority == 0}
    config = _resolve(pm)
    assert choose_strategy(config, None, strategies).name == "single"
    with pytest.raises(UsageError, match="4 processes need a data-parallel strategy and none "
                                         "is installed that --strategy auto may pick"):
        choose_strategy(config, 4, strategies)


class Restarting:
    """A plugin whose runs resume every start from their folder (as --max-restarts does)."""

    @hookimpl
    def distrun_continues_run(self, config):
        return True


@pytest.mark.parametrize("plugins, kept", [((), False), ((Restarting(),), True)])
def test_a_run_continues_its_folder_only_when_resume_or_a_plugin_says_so(tmp_path, plugins,
                                                                         kept):
    from distrun._config.run_dir import fresh_run_folder

    earlier = tmp_path / "demo"
    earlier.mkdir()
    (earlier / "metrics.csv").write_text("step\n")
    config = _resolve(_manager(*plugins), run_dir=str(earlier))
    expected = str(earlier) if kept else f"{earlier}-2"
    assert fresh_run_folder(config).run_dir == expected
    # --resume other than never continues it without any plugin
    assert fresh_run_folder(_resolve(_manager(), run_dir=str(earlier), resume="auto")).run_dir \
        == str(earlier)
