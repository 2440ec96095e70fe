"""Run config precedence (flag > env > file > code > default), validation and provenance."""

from __future__ import annotations

import dataclasses
import json

import pytest

from distrun._config.run_config import RunConfig, core_options, resolve_config
from distrun._spec.errors import UsageError
from distrun._spec.options import Option

PLUGIN = Option("demo_level", int, 3, help="a plugin option", min=0, plugin="demo")


def resolve(**kw):
    kw.setdefault("environ", {})
    return resolve_config([*core_options(), PLUGIN], **kw)


def test_defaults():
    cfg = resolve()
    assert cfg.max_epochs == 1 and cfg.strategy == "auto" and cfg.get("demo_level") == 3
    assert dict(cfg.sources) == {}


def test_precedence_flag_env_file_code(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("max_epochs = 4\nbatch_size = 16\nseed = 7\n[demo]\nlevel = 5\n")
    cfg = resolve(
        code={"max_epochs": 2, "batch_size": 8, "seed": 1, "grad_accum": 3},
        config_file=str(toml),
        environ={"DISTRUN_BATCH_SIZE": "64", "DISTRUN_SEED": "9"},
        flags={"seed": "11"},
    )
    assert (cfg.max_epochs, cfg.batch_size, cfg.seed, cfg.grad_accum) == (4, 64, 11, 3)
    assert cfg.get("demo_level") == 5  # [demo] level -> demo_level
    assert cfg.sources["seed"] == "flag"
    assert cfg.sources["batch_size"] == "DISTRUN_BATCH_SIZE"
    assert cfg.sources["max_epochs"] == str(toml)
    assert cfg.sources["grad_accum"] == "code"


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolve().max_epochs = 3


def test_distrun_table_in_toml(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[distrun]\nstrategy = 'single'\nmax_steps = 9\n")
    cfg = resolve(config_file=str(toml))
    assert cfg.strategy == "single" and cfg.max_steps == 9


def test_launcher_values_round_trip_through_json():
    cfg = resolve(flags={"max_steps": "5", "demo_level": "2"})
    inherited = json.loads(cfg.to_json())["values"]
    again = resolve(inherited=inherited)
    assert again.max_steps == 5 and again.get("demo_level") == 2


@pytest.mark.parametrize("kw, message", [
    ({"flags": {"max_epochs": "x"}}, "invalid value for --max-epochs: 'x' is not a whole number"),
    ({"flags": {"demo_level": "-1"}}, "--demo-level: -1 is below the minimum 0"),
    ({"code": {"max_epoch": 3}}, "unknown option 'max_epoch' in Trainer(...) arguments; "
                                 "did you mean 'max_epochs'?"),
    ({"flags": {"summary": "maybe"}}, "is not true or false"),
    ({"flags": {"nnodes": "a:b"}}, "invalid value for --nnodes"),
    ({"flags": {"resume": "/no/such/ckpt"}}, "--resume /no/such/ckpt: no such checkpoint"),
])
def test_invalid_values_raise_usage_errors(kw, message):
    with pytest.raises(UsageError) as info:
        resolve(**kw)
    assert message in str(info.value)


def test_toml_value_types_are_checked(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("max_epochs = 2.5\n")
    with pytest.raises(UsageError, match=f"'max_epochs' in {toml}"):
        resolve(config_file=str(toml))


def test_every_core_field_is_an_option():
    names = {o.name for o in core_options()}
    fields = {f.name for f in dataclasses.fields(RunConfig)} - {"plugin_options", "sources",
                                                                 "pluginmanager", "_typed"}
    assert names == fields
