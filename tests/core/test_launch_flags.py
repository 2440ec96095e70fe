"""`distrun run` hands its own -p flags to the workers: the argv main() was given, never the
interpreter's sys.argv (a program or test that calls main(argv) in-process)."""

from __future__ import annotations

PROBE = '''
import json, os
from distrun import hookimpl


@hookimpl(tryfirst=True)
def distrun_launch(config, command, environ):
    with open(os.environ["PROBE_OUT"], "w") as out:
        json.dump({k: environ.get(k) for k in ("DISTRUN_BLOCK_PLUGINS", "DISTRUN_PLUGINS")}, out)
    return 0
'''


def test_workers_get_the_plugin_flags_main_was_given(cli, tmp_path, monkeypatch):
    import json

    (tmp_path / "launch_probe.py").write_text(PROBE)
    (tmp_path / "script.py").write_text("print('never runs')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = cli("-p", "launch_probe", "-p", "no:csv_logger", "run", "script.py", cwd=tmp_path,
                 env={"PROBE_OUT": str(tmp_path / "env.json"), "DISTRUN_BLOCK_PLUGINS": None,
                      "DISTRUN_PLUGINS": None})
    assert result.returncode == 0, result
    seen = json.loads((tmp_path / "env.json").read_text())
    assert seen == {"DISTRUN_BLOCK_PLUGINS": "csv_logger", "DISTRUN_PLUGINS": "launch_probe"}
