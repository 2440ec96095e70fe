"""Not part of the suite (not ``test_*``): ``test_ray_head`` runs it in a pytest of its own and
kills that pytest with SIGKILL while this test holds the session's Ray head.

It writes the head's processes and session folder to ``$HOLD_HEAD_FILE``, then sleeps.
"""

from __future__ import annotations

import json
import os
import time


def test_hold_the_head(ray_cluster):
    path = os.environ["HOLD_HEAD_FILE"]
    info = {"pids": sorted(ray_cluster.processes()), "temp_dir": ray_cluster.temp_dir}
    with open(f"{path}.tmp", "w") as fh:
        json.dump(info, fh)
    os.replace(f"{path}.tmp", path)
    time.sleep(600)
