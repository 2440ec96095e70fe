"""A torchrun-style script that says which backend its groups got.

``plain``: ``init_process_group()`` with no backend named (as most torchrun scripts do).
``mesh``: distrun's own group and a 2 x 1 device mesh with a collective timeout.
"""

import sys

import torch
import torch.distributed as dist

mode = sys.argv[1]
if mode == "plain":
    dist.init_process_group()
else:
    from distrun._config.parallel_dims import ParallelDims
    from distrun._registry.manager import make_plugin_manager
    from distrun._strategies.mesh import build_mesh
    from distrun._strategies.process_group import init_process_group
    from distrun._train.trainer import worker_config

    config = worker_config(make_plugin_manager())
    init_process_group(config, torch.device("cpu"))
    mesh = build_mesh(ParallelDims(world_size=2, dp=1, tp=2), "cpu", timeout=7)
    tp = mesh.get_group("tp")
    print(f"rank {dist.get_rank()} mesh tp {dist.get_backend(tp)} "
          f"{tp._get_backend(torch.device('cpu')).options._timeout.total_seconds():.0f}s")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} backend {dist.get_backend_config()} sum {t.item():.0f}",
      flush=True)
dist.destroy_process_group()
