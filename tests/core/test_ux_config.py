"""`distrun config init` and `distrun config show`: the template, precedence and sources.

All in-process (the `cli` fixture): nothing here launches."""

from __future__ import annotations

import json
import re

import tomllib


def show(cli, tmp_path, *args, env=None) -> dict:
    result = cli("config", "show", "--json", *args, cwd=tmp_path, env=env)
    assert result.returncode == 0, result
    return json.loads(result.stdout)


def test_init_writes_a_commented_template_of_every_option(cli, tmp_path):
    result = cli("config", "init", cwd=tmp_path)
    assert result.returncode == 0, result
    text = (tmp_path / "run.toml").read_text()
    assert tomllib.loads(text) == {}  # everything commented: the file changes nothing
    names = set(show(cli, tmp_path))
    templated = set(re.findall(r"^# ([a-z_0-9]+) =", text, re.M))  # unset ones end at =
    assert templated == names  # every installed option, core's and plugins'
    assert "# ---- core" in text and "# ---- console" in text
    help_block = text.split("# GLOBAL batch per micro-step", 1)[1].split("# batch_size = ")[0]
    assert "[--batch-size, DISTRUN_BATCH_SIZE]" in help_block.replace("\n# ", " ")
    assert "# batch_size = 32\n" in text


def test_an_uncommented_template_is_a_valid_config(cli, tmp_path):
    cli("config", "init", "-o", "all.toml", cwd=tmp_path)
    text = (tmp_path / "all.toml").read_text()
    # Uncomment every key that has a value, and change two of them.
    body = re.sub(r"^# ([a-z_0-9]+ = .+)$", r"\1", text, flags=re.M)
    body = body.replace("max_epochs = 1\n", "max_epochs = 7\n")
    body = body.replace('device = "auto"\n', 'device = "cpu"\n')
    (tmp_path / "all.toml").write_text(body)
    shown = show(cli, tmp_path, "--config", "all.toml")
    assert shown["max_epochs"] == {"value": 7, "source": "all.toml"}
    assert shown["device"] == {"value": "cpu", "source": "all.toml"}
    assert shown["batch_size"] == {"value": 32, "source": "all.toml"}


def test_init_refuses_to_overwrite(cli, tmp_path):
    (tmp_path / "run.toml").write_text("seed = 1\n")
    result = cli("config", "init", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: run.toml exists (pass --force to overwrite it, "
                                     "or -o OTHER.toml)")
    assert (tmp_path / "run.toml").read_text() == "seed = 1\n"
    assert cli("config", "init", "--force", cwd=tmp_path).returncode == 0


def test_show_says_where_each_value_came_from(cli, tmp_path):
    (tmp_path / "run.toml").write_text("seed = 1\nmax_epochs = 4\nbatch_size = 16\n")
    env = {"DISTRUN_MAX_EPOCHS": "5", "DISTRUN_GRAD_ACCUM": "2"}
    shown = show(cli, tmp_path, "--config", "run.toml", "--batch-size", "8", env=env)
    assert shown["seed"] == {"value": 1, "source": "run.toml"}
    assert shown["max_epochs"] == {"value": 5, "source": "DISTRUN_MAX_EPOCHS"}  # env > file
    assert shown["batch_size"] == {"value": 8, "source": "flag"}  # flag > file
    assert shown["grad_accum"] == {"value": 2, "source": "DISTRUN_GRAD_ACCUM"}
    assert shown["log_every_n_steps"] == {"value": 10, "source": "default"}
    result = cli("config", "show", "--config", "run.toml", "--batch-size", "8",
                     cwd=tmp_path, env=env)
    assert result.returncode == 0, result
    assert "seed = 1  # run.toml\n" in result.stdout
    assert "batch_size = 8  # flag\n" in result.stdout
    assert tomllib.loads(result.stdout)["max_epochs"] == 5


def test_show_rejects_bad_input_in_one_line(cli, tmp_path):
    (tmp_path / "bad.toml").write_text("max_epoch = 3\n")
    result = cli("config", "show", "--config", "bad.toml", cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown key 'max_epoch' in bad.toml; did you mean 'max_epochs'?" in result.stderr
    result = cli("config", "show", "--max-epochs", "zero", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
