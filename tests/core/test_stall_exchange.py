"""Across nodes, the stall watchers' reports meet in the run's store
(:mod:`distrun._diagnose.exchange`). A watcher that has every node's report goes on, and under
``--on-stall stop`` ends its workers, the store's host among them: so no rank hands its watcher
the reports before every node that published has read the others'."""

from __future__ import annotations

import datetime
import gc
import json
import threading
import time

import torch.distributed as dist

from distrun._diagnose import exchange, summary
from distrun._diagnose.position import Phase, Position


def _env(port: int, node: int) -> dict[str, str]:
    return {"GROUP_WORLD_SIZE": "2", "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
            "DISTRUN_RDZV_GENERATION": "3"}


def test_a_node_holds_its_watcher_until_the_other_node_read_its_report(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    folder = tmp_path / "node0"
    folder.mkdir()
    (folder / "node-1.json").write_text(json.dumps({"seen": [0]}))
    node0 = threading.Thread(target=exchange._answer, args=("1", str(folder),
                                                            _env(store.port, 0)))
    node0.start()
    prefix = f"{exchange.KEY_PREFIX}/0/3/1"
    store.set(f"{prefix}/1", json.dumps({"seen": [1]}))  # node 1 published, has not read
    node0.join(timeout=1.5)
    assert node0.is_alive()  # its watcher would stop the workers and perhaps the store
    assert not (folder / "reports-1.json").exists()
    store.set(f"{prefix}/read/1", "1")  # node 1 has node 0's report now
    node0.join(timeout=10)
    assert not node0.is_alive()
    assert json.loads((folder / "reports-1.json").read_text()) == {"0": {"seen": [0]},
                                                                    "1": {"seen": [1]}}
    assert store.check([f"{prefix}/read/0"])  # and it told node 1 it read its report


def test_a_request_is_answered_though_posted_before_the_node_first_looked(tmp_path):
    """A rank whose first look at the store comes after another node asked (its client
    failed, or it joined late) still answers; one whose asker stopped collecting is passed
    over. (Each rank looks every LOOK seconds; the CI run that named no rank of node 0 had
    a rank that took the requests before its first look for old ones.)"""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    prefix = f"{exchange.KEY_PREFIX}/0/3"
    asker = exchange._Asks(str(tmp_path), _env(store.port, 1))
    asker.post(store, "stacks-late")  # node 1's distrun stacks, before node 0 ever looked
    asker.post(store, "stacks-old")
    store.set(f"{prefix}/stacks-old/read/1", "1")  # node 1 gave up on this one
    folder = tmp_path / "node0"
    folder.mkdir()
    node0 = exchange._Asks(str(folder), _env(store.port, 0))
    node0.store = exchange._store(_env(store.port, 0), 10)  # (its rank joined its group)
    node0.look()
    assert json.loads(store.get(f"{prefix}/stacks-late/0")) == {"views": []}  # (no records)
    assert store.check([f"{prefix}/stacks-late/read/0"])
    assert not store.check([f"{prefix}/stacks-old/0"])
    asker.post(store, "stacks-next")  # and the next request, at the next look
    node0.look()
    assert store.check([f"{prefix}/stacks-next/0"])


def test_a_node_whose_store_ends_after_it_collected_still_hands_over_every_report(tmp_path):
    """The node holding the store may go on (and end its workers, the store with them) as
    soon as every node read its report: a node still waiting for the others' marks then
    loses the store, and hands over what it collected all the same. (Under load, srun's
    tasks lost the first task's report this way: the second task's line said its rank was
    not seen.)"""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    prefix = f"{exchange.KEY_PREFIX}/0/3/1"
    store.set(f"{prefix}/0", json.dumps({"seen": [0]}))  # node 0 published, not yet read
    folder = tmp_path / "node1"
    folder.mkdir()
    (folder / "node-1.json").write_text(json.dumps({"seen": [1]}))
    node1 = threading.Thread(target=exchange._answer, args=("1", str(folder),
                                                            _env(store.port, 1)))
    node1.start()
    deadline = time.monotonic() + 10
    while not store.check([f"{prefix}/read/1"]):  # node 1 collected and said so
        assert time.monotonic() < deadline
        time.sleep(0.02)
    del store  # node 0 went on and its workers ended: the store is gone
    gc.collect()
    node1.join(timeout=15)
    assert not node1.is_alive()
    assert json.loads((folder / "reports-1.json").read_text()) == {"0": {"seen": [0]},
                                                                    "1": {"seen": [1]}}


def test_a_group_of_one_rank_that_did_not_report_is_named_as_a_rank_not_a_node():
    """srun's tasks and Ray's actors are groups of one rank: a missing report is that rank's
    (the index of the group is the rank, not a node); a node's stays the node's. A busy flag
    of another node's view crosses the store in its report."""
    now = time.monotonic()
    waits = Position(0, 11, True, Phase.BACKWARD, now - 9, "all_reduce", 40, now - 9, 19, 0.01)
    mine = summary.RankView(0, "h0", 11, "running", waits)
    assert summary.summarize([mine], now, unseen="1", unit="rank").endswith(
        "rank 1 is not seen here (its report did not come in time; its launcher prints its "
        "own line)")
    assert "ranks 1,2 are not seen here (their reports did not come in time; each one's " \
        "launcher" in summary.summarize([mine], now, unseen="1,2", unit="rank")
    assert "the ranks of node 1 are not seen here (its report did not come in time; that " \
        "node's launcher" in summary.summarize([mine], now, unseen="1")
    mine.busy = True
    assert [v.busy for v in summary.views_of(json.loads(json.dumps(
        summary.report_of([mine], now))), now)] == [True]
