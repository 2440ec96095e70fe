"""Role layout, shard placement and the server's update batching, in one process."""

from __future__ import annotations

import pytest
import torch

from distrun import UsageError
from distrun_rpc.roles import Roles, assign_shards


def test_trainers_first_servers_last():
    layout = [Roles.of(rank, 5, 2) for rank in range(5)]
    assert [r.name for r in layout] == ["trainer0", "trainer1", "trainer2", "server0", "server1"]
    assert [r.role_world_size for r in layout] == [3, 3, 3, 2, 2]
    assert layout[4].describe("server1") == "parameter server 1 (rank 4)"
    assert layout[0].describe("trainer2") == "trainer 2 (rank 2)"
    env: dict[str, str] = {}
    layout[3].export(env)
    assert env == {"ROLE_NAME": "server", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "2"}


@pytest.mark.parametrize("world,servers", [(2, 2), (3, 5), (4, 0)])
def test_impossible_layouts_are_usage_errors(world, servers):
    with pytest.raises(UsageError, match="--rpc-servers"):
        Roles.of(0, world, servers)


def test_shards_balance_sizes_deterministically():
    sizes = [100, 10, 90, 5, 5]
    owner = assign_shards(sizes, 2)
    assert owner == assign_shards(sizes, 2)
    load = [sum(s for s, o in zip(sizes, owner) if o == k) for k in range(2)]
    assert load == [105, 105]  # 100+5 and 90+10+5
    assert assign_shards(sizes, 1) == [0] * 5


def _server(update_batch: int, trainers: int):
    from distrun_rpc.server import ServerState

    st = ServerState(0, trainers, update_batch=update_batch)
    st.names = ["w"]
    st.params = [torch.nn.Parameter(torch.zeros(2))]
    st.optimizer = torch.optim.SGD(st.params, lr=1.0)
    return st


def test_async_updates_wait_for_a_full_batch_and_average_it():
    st = _server(update_batch=2, trainers=2)
    first = st.push([torch.tensor([1.0, 2.0])])
    assert not first.done() and st.updates == 0  # waits for the second push
    second = st.push([torch.tensor([3.0, 4.0])])
    assert first.done() and second.done() and st.updates == 1
    assert torch.equal(first.wait()[0], torch.tensor([-2.0, -3.0]))  # minus the mean gradient


def test_a_finished_trainer_releases_a_partial_batch():
    st = _server(update_batch=2, trainers=2)
    pending = st.push([torch.tensor([2.0, 2.0])])
    st.trainer_done("trainer1", failed=False)  # nobody else will push: update with one
    assert pending.done() and st.updates == 1
    assert torch.equal(pending.wait()[0], torch.tensor([-2.0, -2.0]))
    st.trainer_done("trainer0", failed=False)
    assert st.done.is_set() and not st.failed


def test_unbatched_updates_apply_each_push():
    st = _server(update_batch=1, trainers=2)
    for _ in range(3):
        assert st.push([torch.ones(2)]).done()
    assert st.updates == 3 and torch.equal(st.params[0].detach(), torch.full((2,), -3.0))


def test_server_state_round_trips_through_plain_values():
    st = _server(update_batch=1, trainers=1)
    st.optimizer = torch.optim.Adam(st.params, lr=0.1)
    st.push([torch.ones(2)])
    saved = st.state_dict()
    assert set(saved["optimizer"]["state"]) == {"0"}  # JSON-able keys
    other = _server(update_batch=1, trainers=1)
    other.optimizer = torch.optim.Adam(other.params, lr=0.1)
    other.load_state_dict(saved)
    assert torch.equal(other.params[0], st.params[0])
    st.push([torch.ones(2)])
    other.push([torch.ones(2)])
    assert torch.equal(other.params[0], st.params[0])  # Adam moments came back too
