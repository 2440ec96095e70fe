"""Rank functions for the distrun-shm tests (importable by spawned ranks)."""

from __future__ import annotations

import datetime
import faulthandler
import functools
import os
import time
from typing import Any

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]
OPS = ["SUM", "AVG", "MIN", "MAX", "PRODUCT"]
SIZES = [7, 20_011, 300_007]  # whole-chunk path; sliced path; several chunks (1 MB slots)


def init_shm(rank: int, world: int, timeout: float = 30.0) -> None:
    from distrun_shm.backend import load

    load()
    dist.init_process_group("shm", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))


def data(rank: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: the same on every rank that asks (so each computes references)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) < 0.7
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n,), generator=gen, dtype=torch.int64).to(dtype)
    return torch.randint(-100, 100, (n,), generator=gen).to(dtype)


def reference(xs: list[torch.Tensor], op: str, premul: float = 1.0) -> torch.Tensor:
    """The result the backend promises: rank order; half types in float32, rounded once."""
    dtype = xs[0].dtype
    if dtype == torch.bool:
        fold = {"SUM": torch.logical_or, "MAX": torch.logical_or, "PRODUCT": torch.logical_and,
                "MIN": torch.logical_and}[op]
        return functools.reduce(fold, xs)
    low = dtype in (torch.bfloat16, torch.float16)
    terms = [x.float() if low else x for x in xs]
    if premul != 1.0:
        terms = [t * premul for t in terms]
    fold = {"SUM": torch.add, "AVG": torch.add, "PREMUL_SUM": torch.add, "PRODUCT": torch.mul,
            "MIN": torch.minimum, "MAX": torch.maximum}[op]
    out = functools.reduce(lambda a, b: fold(a, b).to(a.dtype), terms)
    if op == "AVG":
        out = out / len(xs) if out.is_floating_point() else torch.div(out, len(xs),
                                                                       rounding_mode="trunc")
    return out.to(dtype)


def _mismatch(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{name}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
    same = torch.equal(got, want) if not got.is_floating_point() else bool(
        ((got == want) | (got.isnan() & want.isnan())).all())
    if not same:
        bad = (got != want).nonzero()[:3].flatten().tolist()
        return f"{name}: differs at {bad}: {got.flatten()[bad].tolist()} vs " \
               f"{want.flatten()[bad].tolist()}"
    return None


def check_all_reduce(rank: int, world: int) -> list[str]:
    """Every op x dtype x size (and a non-contiguous view): bit-equal to the reference."""
    init_shm(rank, world)
    errors = []
    for n in SIZES:
        for dtype in DTYPES:
            for op in OPS:
                if dtype == torch.bool and op == "AVG":
                    continue
                xs = [data(r, n, dtype) for r in range(world)]
                t = xs[rank].clone()
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                err = _mismatch(f"all_reduce {op} {dtype} n={n}", t, reference(xs, op))
                if err:
                    errors.append(err)
    for dtype in (torch.float32, torch.bfloat16):
        xs = [data(r, 64 * 9, dtype).view(64, 9) for r in range(world)]
        base = xs[rank].clone()
        view = base[:, ::2]  # non-contiguous: reduced in a copy, written back
        dist.all_reduce(view)
        want = reference([x[:, ::2].contiguous() for x in xs], "SUM")
        err = _mismatch(f"non-contiguous {dtype}", view.contiguous(), want)
        errors.append(err) if err else None
        if not torch.equal(base[:, 1::2], xs[rank][:, 1::2]):
            errors.append("non-contiguous: elements outside the view changed")
    for dtype in (torch.float32, torch.bfloat16):
        xs = [data(r, 20_011, dtype) for r in range(world)]
        t = xs[rank].clone()
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.25))
        err = _mismatch(f"PREMUL_SUM {dtype}", t, reference(xs, "PREMUL_SUM", 0.25))
        errors.append(err) if err else None
    for op in ("BAND", "BOR", "BXOR"):
        xs = [data(r, 1000, torch.int32) for r in range(world)]
        t = xs[rank].clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        fold = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}
        err = _mismatch(f"{op}", t, functools.reduce(fold[op], xs))
        errors.append(err) if err else None
    dist.destroy_process_group()
    return errors


def check_other_collectives(rank: int, world: int) -> list[str]:
    """broadcast, all_gather(_into_tensor), reduce_scatter(_tensor), all_to_all(_single),
    gather, scatter, reduce, send/recv, batch_isend_irecv, object collectives, barrier."""
    init_shm(rank, world)
    errors: list[str] = []

    def expect(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        err = _mismatch(name, got, want)
        if err:
            errors.append(err)

    for n in (5, 400_003):  # one chunk; several
        for root in range(world):
            t = data(rank, n, torch.float32) if rank == root else torch.zeros(n)
            dist.broadcast(t, src=root)
            expect(f"broadcast n={n} root={root}", t, data(root, n, torch.float32))
        outs = [torch.empty(n, dtype=torch.bfloat16) for _ in range(world)]
        dist.all_gather(outs, data(rank, n, torch.bfloat16))
        for r in range(world):
            expect(f"all_gather n={n} from {r}", outs[r], data(r, n, torch.bfloat16))
        flat = torch.empty(world * n, dtype=torch.int64)
        dist.all_gather_into_tensor(flat, data(rank, n, torch.int64))
        expect(f"all_gather_into_tensor n={n}",
               flat, torch.cat([data(r, n, torch.int64) for r in range(world)]))
        inplace = torch.zeros(world * n)  # FSDP's shape: the input is the rank's own slice
        inplace[rank * n:(rank + 1) * n] = data(rank, n, torch.float32)
        dist.all_gather_into_tensor(inplace, inplace[rank * n:(rank + 1) * n])
        expect(f"in-place all_gather_into_tensor n={n}",
               inplace, torch.cat([data(r, n, torch.float32) for r in range(world)]))
        for dtype, op in ((torch.float32, "SUM"), (torch.bfloat16, "AVG"), (torch.int64, "MAX")):
            full = [data(r, world * n, dtype, seed=3) for r in range(world)]
            want = reference([f[rank * n:(rank + 1) * n] for f in full], op)
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, full[rank], op=getattr(dist.ReduceOp, op))
            expect(f"reduce_scatter_tensor {op} {dtype} n={n}", out, want)
            out2 = torch.empty(n, dtype=dtype)
            dist.reduce_scatter(out2, list(full[rank].chunk(world)),
                                op=getattr(dist.ReduceOp, op))
            expect(f"reduce_scatter {op} {dtype} n={n}", out2, want)
    # all_to_all_single with uneven splits: rank r sends (r + j + 1) rows of 3 to rank j
    rows = [[(r + j + 1) * 1000 + 1 for j in range(world)] for r in range(world)]
    send = torch.cat([torch.full((rows[rank][j], 3), float(rank * 10 + j)) for j in range(world)])
    recv = torch.empty(sum(rows[j][rank] for j in range(world)), 3)
    dist.all_to_all_single(recv, send, output_split_sizes=[rows[j][rank] for j in range(world)],
                           input_split_sizes=rows[rank])
    expect("all_to_all_single uneven", recv,
           torch.cat([torch.full((rows[j][rank], 3), float(j * 10 + rank))
                      for j in range(world)]))
    ins = [torch.full((4,), float(rank * 10 + j)) for j in range(world)]
    outs = [torch.empty(4) for _ in range(world)]
    dist.all_to_all(outs, ins)
    for j in range(world):
        expect(f"all_to_all from {j}", outs[j], torch.full((4,), float(j * 10 + rank)))
    root = world - 1
    got = [torch.empty(6) for _ in range(world)] if rank == root else None
    dist.gather(data(rank, 6, torch.float32), got, dst=root)
    if rank == root:
        for r in range(world):
            expect(f"gather from {r}", got[r], data(r, 6, torch.float32))
    out = torch.empty(300_001)
    dist.scatter(out, [data(r, 300_001, torch.float32) for r in range(world)]
                 if rank == 0 else None, src=0)
    expect("scatter", out, data(rank, 300_001, torch.float32))
    t = data(rank, 1000, torch.float64)
    dist.reduce(t, dst=1, op=dist.ReduceOp.SUM)
    if rank == 1:
        expect("reduce", t, reference([data(r, 1000, torch.float64) for r in range(world)],
                                      "SUM"))
    # send/recv around the ring, larger than a ring buffer, all at once (batch_isend_irecv)
    n = 200_000
    right, left = (rank + 1) % world, (rank - 1) % world
    got_left = torch.empty(n)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, data(rank, n, torch.float32), right),
                                   dist.P2POp(dist.irecv, got_left, left)])
    for req in reqs:
        req.wait()
    expect("batch_isend_irecv", got_left, data(left, n, torch.float32))
    if rank == 0:
        dist.send(data(0, 77, torch.int16), dst=world - 1, tag=7)
    elif rank == world - 1:
        r = torch.empty(77, dtype=torch.int16)
        dist.recv(r, src=0, tag=7)
        expect("send/recv", r, data(0, 77, torch.int16))
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "pad": "x" * rank * 100})
    if [o["rank"] for o in objs] != list(range(world)):
        errors.append(f"all_gather_object: {objs}")
    box = [{"from": 0, "n": list(range(50))}] if rank == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    if box[0] != {"from": 0, "n": list(range(50))}:
        errors.append(f"broadcast_object_list: {box}")
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(("hi", rank), gathered, dst=0)
    if rank == 0 and gathered != [("hi", r) for r in range(world)]:
        errors.append(f"gather_object: {gathered}")
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, [f"to {r}" for r in range(world)] if rank == 0 else None,
                             src=0)
    if mine[0] != f"to {rank}":
        errors.append(f"scatter_object_list: {mine}")
    work = dist.all_reduce(torch.ones(3), async_op=True)
    fut_value = work.get_future().wait()
    if not (isinstance(fut_value, list) and torch.equal(fut_value[0], torch.full((3,),
                                                                                 float(world)))):
        errors.append(f"future value: {fut_value}")
    dist.barrier()
    dist.destroy_process_group()
    return errors


def check_subgroups_and_mesh(rank: int, world: int) -> list[str]:
    """new_group over subsets (in any order of creation) and a 2 x 2 DeviceMesh on shm."""
    from torch.distributed.device_mesh import init_device_mesh

    init_shm(rank, world)
    errors = []
    evens = dist.new_group([0, 2], backend="shm")
    odds = dist.new_group([1, 3], backend="shm")
    three = dist.new_group([0, 1, 3], backend="shm")
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=mine)
    if t.item() != (4.0 if rank % 2 == 0 else 6.0):
        errors.append(f"pair group sum {t.item()}")
    if rank in (0, 1, 3):
        u = torch.tensor([float(rank)])
        dist.all_reduce(u, op=dist.ReduceOp.MAX, group=three)
        if u.item() != 3.0:
            errors.append(f"three-rank group max {u.item()}")
        g = [torch.empty(1) for _ in range(3)]
        dist.all_gather(g, torch.tensor([float(rank)]), group=three)
        if [x.item() for x in g] != [0.0, 1.0, 3.0]:
            errors.append(f"three-rank all_gather {g}")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        group = mesh.get_group(dim)
        if dist.get_backend(group) != "shm":
            errors.append(f"mesh {dim} group backend {dist.get_backend(group)}")
        v = torch.tensor([float(rank)])
        dist.all_reduce(v, group=group)
        peers = dist.get_process_group_ranks(group)
        if v.item() != float(sum(peers)):
            errors.append(f"mesh {dim}: {v.item()} != sum of {peers}")
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.arange(16.0).view(4, 4)
    dt = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    back = dt.redistribute(mesh, [Replicate(), Replicate()]).to_local()
    if not torch.equal(back, full):
        errors.append("DTensor redistribute over the mesh changed the values")
    dist.destroy_process_group()
    return errors


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def train_ddp_both(rank: int, world: int, hooks: list[str]) -> dict[str, Any]:
    """The same DDP training over a gloo group and an shm group, per comm hook; losses and
    final weights per (hook, backend)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distrun_shm.backend import load

    load()
    groups = {"gloo": dist.group.WORLD, "shm": dist.new_group(backend="shm")}
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen))
               for _ in range(8)]
    out: dict[str, Any] = {}
    for hook in hooks:
        for name, group in groups.items():
            model = DDP(mlp(), process_group=group, bucket_cap_mb=0.01)  # several buckets
            if hook == "fp16":
                model.register_comm_hook(group, default_hooks.fp16_compress_hook)
            elif hook == "bf16":
                model.register_comm_hook(group, default_hooks.bf16_compress_hook)
            elif hook == "powersgd":
                state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                           start_powerSGD_iter=2, random_seed=0)
                model.register_comm_hook(state, psgd.powerSGD_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            losses = []
            for x, y in batches:
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            out[f"{hook} {name}"] = {"losses": torch.stack(losses),
                                     "weights": [p.detach().clone() for p in model.parameters()]}
    return out


def zero_both(rank: int, world: int) -> dict[str, Any]:
    """ZeroRedundancyOptimizer (Adam) over DDP, on gloo and on shm: final weights."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distrun_shm.backend import load

    load()
    groups = {"gloo": dist.group.WORLD, "shm": dist.new_group(backend="shm")}
    gen = torch.Generator().manual_seed(7 + rank)
    batches = [(torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen))
               for _ in range(5)]
    out = {}
    for name, group in groups.items():
        model = DDP(mlp(), process_group=group)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                      process_group=group, lr=1e-2)
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.consolidate_state_dict(to=0)
        out[name] = [p.detach().clone() for p in model.parameters()]
    return out


def unsupported_op(rank: int, world: int) -> dict[str, str]:
    """The one-line errors of ops shm does not do (and of wrong input), then a working op."""
    init_shm(rank, world)
    seen = {}
    t = torch.zeros(3)
    try:
        dist.recv(t)  # from any source: shm matches senders by rank only
    except RuntimeError as exc:
        seen["recv_anysource"] = str(exc)
    try:
        dist.all_reduce(torch.zeros(3, dtype=torch.uint32))
    except (RuntimeError, ValueError) as exc:
        seen["uint32"] = str(exc)
    try:
        dist.all_reduce(torch.zeros(3), op=dist.ReduceOp.BAND)
    except (RuntimeError, ValueError) as exc:
        seen["band_float"] = str(exc)
    u = torch.ones(2)
    dist.all_reduce(u)  # the group still works after refused calls
    seen["after"] = str(u.tolist())
    dist.destroy_process_group()
    return seen


def other_machine(rank: int, world: int) -> str:
    """Each rank claims another machine: making the group is refused with one line."""
    os.environ["DISTRUN_SHM_MACHINE_ID"] = f"node{rank}"
    try:
        init_shm(rank, world, timeout=20)
    except Exception as exc:  # noqa: BLE001 - the test checks its type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def pid_of(rank: int, world: int) -> int:
    return os.getpid()


def failing_rank(rank: int, world: int, how: str, queue: Any) -> None:
    """Rank 1 fails as ``how`` says in the middle of training; rank 0 reports what it saw.

    Each stage is reported, and a rank still running after 75 s prints every thread's stack
    (captured by pytest): a hang says where it is."""
    faulthandler.dump_traceback_later(75, exit=False)
    queue.put(("stage", rank, "init"))
    init_shm(rank, world, timeout=60 if how != "stall" else 3)
    queue.put(("pid", rank, os.getpid()))
    t = torch.ones(1000)
    for _ in range(3):
        dist.all_reduce(t)
    if rank == 1:
        if how == "kill":
            # The queue's messages go out on a feeder thread that holds the queue's shared
            # write lock while it writes: killed in that moment, this rank would leave the lock
            # taken and rank 0's result could never be sent (seen under load). Flush first.
            queue.close()
            queue.join_thread()
            os.kill(os.getpid(), 9)
        if how == "exception":
            raise SystemExit(3)  # leaves without destroy_process_group, as a crash would
        if how == "stall":
            time.sleep(6)  # alive but late: rank 0 times out meanwhile
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        dist.all_reduce(t)
        queue.put(("result", rank, "no error", time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001
        queue.put(("result", rank, f"{type(exc).__name__}: {exc}", time.monotonic() - start))
