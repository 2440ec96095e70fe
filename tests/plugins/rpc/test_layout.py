"""Role layout, shard placement and the server's update batching, in one process."""

from __future__ import annotations

import pytest
import torch

from distrun.plugin import UsageError
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


def _named_server(names: list[str], values: list[float]):
    from distrun_rpc.server import ServerState

    st = ServerState(0, 1, update_batch=1)
    st.names = names
    st.params = [torch.nn.Parameter(torch.full((2,), v)) for v in values]
    st.optimizer = torch.optim.SGD(st.params, lr=0.1, momentum=0.9)
    return st


def test_server_state_moves_between_shard_layouts():
    # Two servers' parameters and momentum buffers, saved by parameter name, load into one server
    # holding both parameters; it then steps exactly as the two did.
    a, b = _named_server(["a"], [1.0]), _named_server(["b"], [2.0])
    for st in (a, b):
        st.push([torch.ones(2)])
    saved = [a.state_dict(), b.state_dict()]
    assert set(saved[0]["optimizer"]["state"]) == {"a"}  # keyed by name, JSON-able
    merged = {"params": {**saved[0]["params"], **saved[1]["params"]},
              "optimizer": {"state": {**saved[0]["optimizer"]["state"],
                                      **saved[1]["optimizer"]["state"]},
                            "hyper": saved[0]["optimizer"]["hyper"]}}
    both = _named_server(["b", "a"], [0.0, 0.0])
    both.load_state_dict(merged)
    for st in (a, b):
        st.push([torch.ones(2)])
    both.push([torch.ones(2), torch.ones(2)])
    # (within float rounding: the optimizer's step order over its parameters differs)
    assert torch.allclose(both.params[0], b.params[0], rtol=0, atol=1e-6)
    assert torch.allclose(both.params[1], a.params[0], rtol=0, atol=1e-6)
    assert torch.allclose(a.params[0], torch.full((2,), 1.0 - 0.1 - 0.19))  # momentum kept


def test_missing_parameters_in_a_checkpoint_are_an_error():
    st = _named_server(["a", "b"], [0.0, 0.0])
    with pytest.raises(RuntimeError, match="lacks b"):
        st.load_state_dict({"params": {"a": torch.zeros(2)}})
