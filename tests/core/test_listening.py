"""A single-node run listens on loopback only (issue 26, item 3): every listening socket of the
run's process tree, read from /proc while the run holds them open, is on 127.0.0.1 or ::1.

The runs happen where the host name resolves to this machine's outward address (as a server's
does, and unlike many test machines'), so gloo left to itself would listen there."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from distrun._spec.errors import UsageError
from distrun.testing.sockets import HOLD_SCRIPT, listeners_of_held_run

#: a Task: its first step waits until the test has looked
HOLD_TASK = """
import os, time
import torch
from torch import nn
import distrun


class Hold(distrun.Task):
    def configure_model(self):
        return nn.Linear(4, 1)

    def configure_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)

    def train_data(self):
        return torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))

    def training_step(self, model, batch):
        folder = os.environ["HOLD_DIR"]
        open(os.path.join(folder, "ready%s" % os.environ["RANK"]), "w").close()
        while not os.path.exists(os.path.join(folder, "go")):
            time.sleep(0.05)
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
"""


def _listeners(tmp_path: Path, *args: str, ranks: int = 2):
    hold = tmp_path / "hold"
    hold.mkdir()
    listeners, code, output = listeners_of_held_run(
        [sys.executable, "-m", "distrun", "run", *args], hold, ranks, cwd=tmp_path,
        env={"HOLD_DIR": str(hold)})
    assert code == 0, output
    assert listeners, output  # the run's stores and gloo's sockets were seen
    return listeners


def test_a_torchrun_script_listens_on_loopback_only(tmp_path):
    (tmp_path / "hold.py").write_text(HOLD_SCRIPT)
    listeners = _listeners(tmp_path, "--nproc-per-node", "2", "hold.py", str(tmp_path / "hold"))
    exposed = [str(s) for s in listeners if not s.loopback]
    assert not exposed, "\n".join(map(str, listeners))


@pytest.mark.slow
def test_a_ddp_task_listens_on_loopback_only(tmp_path):
    pytest.importorskip("distrun_ddp", reason="needs distrun-ddp")
    (tmp_path / "hold_task.py").write_text(HOLD_TASK)
    listeners = _listeners(tmp_path, "--nproc-per-node", "2", "--strategy", "ddp",
                           "--max-steps", "1", "--batch-size", "8", "--no-summary",
                           "hold_task.py:Hold")
    exposed = [str(s) for s in listeners if not s.loopback]
    assert not exposed, "\n".join(map(str, listeners))


def test_an_interface_the_user_chose_for_gloo_is_kept(tmp_path):
    """GLOO_SOCKET_IFNAME set by the user wins: they chose where gloo listens."""
    (tmp_path / "dump.py").write_text(
        "import os\nprint('ifname', os.environ.get('GLOO_SOCKET_IFNAME'), "
        "os.environ.get('DISTRUN_BIND_ADDRESS'))\n")
    from distrun.testing import run_cli

    ours = run_cli("run", "dump.py", cwd=tmp_path, env={"GLOO_SOCKET_IFNAME": "mine0"})
    assert ours.returncode == 0, ours
    assert ours.stdout.split() == ["ifname", "mine0", "127.0.0.1"]
    if os.path.exists("/sys/class/net/lo"):
        plain = run_cli("run", "dump.py", cwd=tmp_path, env={"GLOO_SOCKET_IFNAME": ""})
        assert plain.stdout.split() == ["ifname", "lo", "127.0.0.1"], plain


def test_the_bind_address_is_decided_in_one_place():
    from distrun._launch.binding import bind_address

    assert bind_address(1) == bind_address(1, "localhost") == "127.0.0.1"
    assert bind_address(1, "::1") == "::1"
    # every node on this machine: loopback; across machines: this host's address toward
    # rank 0's (a routing lookup), or --local-addr; never every interface
    assert bind_address(2, "127.0.0.1") == "127.0.0.1"
    assert bind_address(2, "127.0.0.1", local_addr="127.0.0.1") == "127.0.0.1"
    from distrun._launch.binding import interface_addresses, route_source

    source = route_source("10.0.0.1")
    if source is None:  # no route from here: one line, not torch's every interface
        with pytest.raises(UsageError, match="is not reachable from this host"):
            bind_address(2, "10.0.0.1")
    else:
        assert bind_address(2, "10.0.0.1") == source
        assert source in interface_addresses().values()
