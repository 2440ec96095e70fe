"""A plain torchrun-style script (no torch, no distrun): prints its launch environment.

With ``FAIL_FIRST=1``, rank 1 of the first attempt exits with code 3 after printing; with
``FAIL_ALWAYS=1`` rank 1 does so in every attempt (with ``FAIL_CODE``, default 3), once rank 0
has printed, while rank 0 waits to be stopped.
"""

import json
import os
import sys
import time

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS", "DISTRUN_CONFIG",
        "DISTRUN_RDZV_GENERATION")
env = {k: os.environ.get(k) for k in KEYS}
print("ENV " + json.dumps(env), flush=True)


def rank_0_printed() -> None:
    """Rank 1 fails only once rank 0 of this attempt has printed: under load rank 0 may start
    much later, and the agent stops it as soon as rank 1 fails (its line then never comes)."""
    ready = f"ready-{env['TORCHELASTIC_RUN_ID']}-{env['TORCHELASTIC_RESTART_COUNT']}"
    if env["RANK"] == "0":
        open(ready, "w").close()
    deadline = time.monotonic() + 60
    while env["RANK"] == "1" and not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.05)


if os.environ.get("FAIL_FIRST") and env["TORCHELASTIC_RESTART_COUNT"] == "0":
    rank_0_printed()
    if env["RANK"] == "1":
        print("first attempt fails on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
if os.environ.get("FAIL_ALWAYS"):
    rank_0_printed()
    if env["RANK"] == "1":
        print(f"attempt {env['TORCHELASTIC_RESTART_COUNT']}: step 3 went wrong", file=sys.stderr)
        print("ValueError: injected failure", file=sys.stderr, flush=True)
        sys.exit(int(os.environ.get("FAIL_CODE", "3")))
    time.sleep(120)
