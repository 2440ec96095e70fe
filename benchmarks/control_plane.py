"""The control plane past this machine: what the store-side work of 64 to 4096 ranks costs.

    python benchmarks/control_plane.py                  # 64, 256, 1024, 4096 ranks
    python benchmarks/control_plane.py --quick          # 64, 256
    python benchmarks/control_plane.py --ranks 128,512 --node-size 8

No model and no collectives: each simulated rank is a thread with its own connection to one real
``TCPStore`` (torch's libuv server, in this process, the way rank 0 or the elastic agent hosts it),
and does only the store traffic of distrun's control plane, in the shapes the code uses:

- ``connect``: every rank opens its client connection to the server (what rendezvous starts with);
- ``barrier``: the epoch-end meeting of plain iterables (``_await_ranks`` in the loop): one
  ``add`` per rank, the last one ``set``\\ s the done key, everyone ``wait``\\ s on it;
- ``commit``: the checkpoint commit's fan-in as one server sees it: every rank posts its record
  (its files, sizes and a checksum, ~300 bytes of JSON), rank 0 waits for all and reads them,
  writes the manifest (fsynced, then renamed) and publishes ``latest``, every rank waits for that
  (distrun gathers the records over the process group; the fan-in at rank 0 is the same O(N));
- ``liveness``: one heartbeat interval of the elastic agents (one per node of ``--node-size``
  ranks): each bumps its counter and reads every other node's in one ``multi_get``
  (distrun-elastic's liveness.py), so the store serves nodes^2 small values an interval;
  ``per-key`` is the shape before (one ``add(key, 0)`` round trip per peer), for comparison.

Printed: the seconds of each phase per rank count, and between consecutive counts the growth
exponent ``log(t2/t1) / log(n2/n1)`` (1.0: linear in ranks; 2.0: quadratic). Ranks are threads
of one Python process on this machine's cores, so the absolute times are an upper bound of a
real cluster's server-side cost; the exponents are what the table is for.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable

TIMEOUT = datetime.timedelta(seconds=300)
# thousands of loopback clients: torch warns per socket that it cannot name the peer host
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _record(rank: int) -> bytes:
    """What one rank reports for a checkpoint commit: its files with sizes and checksums."""
    files = {f"model-{rank:05d}-of-N.safetensors": {"size": 1 << 24, "crc32c": "9a3f1c27"},
             f"optim-{rank:05d}-of-N.safetensors": {"size": 1 << 25, "crc32c": "04be77d1"}}
    return json.dumps({"rank": rank, "files": files}).encode()


def _run_threads(n: int, body: Callable[[int], None]) -> float:
    """Run ``body(rank)`` on ``n`` threads released together; seconds until the last ends."""
    go = threading.Event()
    errors: list[BaseException] = []

    def main(rank: int) -> None:
        go.wait()
        try:
            body(rank)
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    start = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} simulated ranks failed: {errors[0]!r}")
    return time.perf_counter() - start


def measure(n: int, node_size: int) -> dict[str, float]:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=TIMEOUT)
    port = server.port
    clients: list = [None] * n
    out: dict[str, float] = {}

    def connect(rank: int) -> None:
        clients[rank] = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)

    out["connect"] = _run_threads(n, connect)

    def barrier(rank: int) -> None:
        store = clients[rank]
        arrived = store.add("epoch_end/0", 1)
        if arrived == n:
            store.set("epoch_end/0/done", "1")
        store.wait(["epoch_end/0/done"])

    out["barrier"] = _run_threads(n, barrier)

    with tempfile.TemporaryDirectory(prefix="distrun-cp-") as folder:
        def commit(rank: int) -> None:
            store = clients[rank]
            store.set(f"ckpt/10/rank/{rank}", _record(rank))
            if rank == 0:
                keys = [f"ckpt/10/rank/{r}" for r in range(n)]
                store.wait(keys)
                records = [json.loads(v) for v in store.multi_get(keys)]
                files = {name: meta for rec in records for name, meta in rec["files"].items()}
                tmp = os.path.join(folder, "manifest.json.tmp")
                with open(tmp, "w") as fh:
                    json.dump({"step": 10, "files": files}, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, os.path.join(folder, "manifest.json"))
                store.set("ckpt/latest", "10")
            store.wait(["ckpt/latest"])

        out["commit"] = _run_threads(n, commit)

    nodes = max(1, n // node_size)

    def per_key(node: int) -> None:
        store = clients[node]
        store.add(f"alive/{node}", 1)
        for other in range(nodes):
            if other != node:
                store.add(f"alive/{other}", 0)

    # the first sweep creates every counter, so the measured ones read existing keys
    out["per-key"] = min(_run_threads(nodes, per_key) for _ in range(2))

    def liveness(node: int) -> None:
        store = clients[node]
        store.add(f"alive/{node}", 1)
        store.multi_get([f"alive/{other}" for other in range(nodes) if other != node])

    out["liveness"] = _run_threads(nodes, liveness)
    del clients[:]
    del server
    return out


PHASES = ("connect", "barrier", "commit", "liveness", "per-key")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="64,256,1024,4096",
                        help="comma-separated simulated world sizes")
    parser.add_argument("--node-size", type=int, default=8,
                        help="ranks per node, for the elastic agents' liveness sweep")
    parser.add_argument("--trials", type=int, default=3, help="medians over this many")
    parser.add_argument("--quick", action="store_true", help="64 and 256 ranks, 1 trial")
    args = parser.parse_args()
    sizes = [64, 256] if args.quick else [int(x) for x in args.ranks.split(",")]
    trials = 1 if args.quick else args.trials

    # The first burst of concurrent connections in a fresh process stalls some clients for
    # 10.0 s on this machine (torch's client socket setup, later bursts do not); one
    # throwaway round keeps that out of the first row.
    measure(64, args.node_size)
    rows: dict[int, dict[str, float]] = {}
    for n in sizes:
        runs = [measure(n, args.node_size) for _ in range(trials)]
        rows[n] = {p: sorted(r[p] for r in runs)[len(runs) // 2] for p in PHASES}
        print(f"{n:>5} ranks ({max(1, n // args.node_size)} nodes): "
              + "  ".join(f"{p} {rows[n][p] * 1e3:8.1f} ms" for p in PHASES), flush=True)

    print("\ngrowth exponent between consecutive sizes (1.0 linear, 2.0 quadratic):")
    print(f"{'ranks':>12}  " + "  ".join(f"{p:>9}" for p in PHASES))
    for a, b in zip(sizes, sizes[1:]):
        exps = [math.log(rows[b][p] / rows[a][p]) / math.log(b / a) for p in PHASES]
        print(f"{a:>5}->{b:<5}  " + "  ".join(f"{e:9.2f}" for e in exps))


if __name__ == "__main__":
    main()
