"""``python -m distrun_ft.lighthouse BIND MIN_REPLICAS HEARTBEAT_MS JOIN_MS``: torchft's
lighthouse in a process of its own; prints its address on one line, serves until SIGTERM."""

from __future__ import annotations

import signal
import sys


def main(argv: list[str]) -> int:
    from torchft._torchft import LighthouseServer

    bind, min_replicas, heartbeat_ms, join_ms = argv
    server = LighthouseServer(bind=bind, min_replicas=int(min_replicas),
                              join_timeout_ms=int(join_ms), quorum_tick_ms=50,
                              heartbeat_timeout_ms=int(heartbeat_ms))
    print(server.address(), flush=True)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    while not stop:
        signal.pause()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
