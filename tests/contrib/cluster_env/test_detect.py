"""Each scheduler's variables give the right ranks and addresses; `distrun env` shows them."""

from __future__ import annotations

import pytest

from distrun import UsageError
from distrun_cluster_env.detect import detect

SLURM_TASKS = {  # srun --nodes 2 --ntasks-per-node 2, task 3 (second task of the second node)
    "SLURM_JOB_ID": "81234", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_TASKS_PER_NODE": "2(x2)",
}
SLURM_NODES = {  # srun --nodes 3 --ntasks-per-node 1: one distrun launcher per node
    "SLURM_JOB_ID": "99", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
    "SLURM_NTASKS": "3", "SLURM_NNODES": "3", "SLURM_NODELIST": "a[1-2]-ib,b3",
}
PYTORCHJOB_NEW = {  # training-operator with nprocPerNode: 3 pods x 2, the second worker pod
    "KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
    "WORLD_SIZE": "6", "RANK": "2", "PET_NNODES": "3", "PET_NODE_RANK": "2",
    "PET_NPROC_PER_NODE": "2", "PYTHONUNBUFFERED": "0",
}
PYTORCHJOB_OLD = {  # older operator: WORLD_SIZE counts pods, RANK is the pod's index
    "KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
    "WORLD_SIZE": "4", "RANK": "3",
}
TORCHELASTIC = {
    "TORCHELASTIC_RUN_ID": "abc", "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29400",
}
OPENMPI = {  # mpirun -np 4 across 2 nodes, rank 2
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "host0", "PMIX_NAMESPACE": "prterun-h-77@1",
}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}


def facts(env):
    c = detect(env)
    return None if c is None else {k: v for k, v in c.__dict__.items() if v is not None}


def test_slurm_one_task_per_rank_runs_in_place():
    assert facts(SLURM_TASKS) == dict(
        name="slurm", per_process=True, rank=3, local_rank=1, world_size=4, nproc_per_node=2,
        nnodes=2, node_rank=1, master_addr="gpu07", master_port=20000 + 81234 % 10000)


def test_slurm_one_task_per_node_spawns_the_node():
    assert facts(SLURM_NODES) == dict(name="slurm", per_process=False, nnodes=3, node_rank=1,
                                      master_addr="a1-ib", master_port=20099)


def test_slurm_step_variables_and_master_exports_win():
    env = {**SLURM_TASKS, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_NODELIST": "gpu[08-09]", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "3333"}
    got = facts(env)
    assert (got["per_process"], got["master_addr"], got["master_port"]) == (False, "10.1.1.1", 3333)


def test_pytorchjob_new_and_old_operators_agree_on_nodes():
    assert facts(PYTORCHJOB_NEW) == dict(name="pytorchjob", per_process=False, nnodes=3,
                                         node_rank=2, nproc_per_node=2,
                                         master_addr="job-master-0", master_port=23456)
    # WORLD_SIZE=4 counts pods here: 4 nodes, not 4 processes.
    assert facts(PYTORCHJOB_OLD) == dict(name="pytorchjob", per_process=False, nnodes=4,
                                         node_rank=3, master_addr="job-master-0",
                                         master_port=23456)


def test_torchelastic_worker():
    assert facts(TORCHELASTIC) == dict(
        name="torchelastic", per_process=True, rank=5, local_rank=1, world_size=8,
        nproc_per_node=4, nnodes=2, node_rank=1, master_addr="10.0.0.9", master_port=29400)


def test_mpi_launchers():
    got = facts(OPENMPI)
    assert {k: got[k] for k in ("rank", "world_size", "local_rank", "nproc_per_node", "nnodes",
                                "node_rank", "master_addr", "per_process")} == dict(
        rank=2, world_size=4, local_rank=0, nproc_per_node=2, nnodes=2, node_rank=1,
        master_addr="host0", per_process=True)
    assert 20000 <= got["master_port"] < 30000
    assert facts({**OPENMPI, "OMPI_COMM_WORLD_RANK": "0"})["master_port"] == got["master_port"]
    # MPICH on one node: rank 0 is here.
    assert facts(MPICH) == dict(name="mpi (pmi)", per_process=True, rank=1, world_size=2,
                                local_rank=1, nproc_per_node=2, nnodes=1, node_rank=0,
                                master_addr="127.0.0.1", master_port=29500)
    # Across nodes without MASTER_ADDR nobody knows rank 0's host: left to the flag / an error.
    assert facts({k: v for k, v in OPENMPI.items() if k != "MASTER_ADDR"}).get("master_addr") \
        is None


def test_nothing_recognised_and_the_selector():
    assert detect({"HOME": "/root", "RANK": "0"}) is None
    assert detect({**SLURM_TASKS, "DISTRUN_CLUSTER_ENV": "none"}) is None
    both = {**SLURM_TASKS, **OPENMPI}
    assert detect(both).name.startswith("mpi")  # mpirun inside an allocation: MPI is specific
    assert detect({**both, "DISTRUN_CLUSTER_ENV": "slurm"}).name == "slurm"
    with pytest.raises(UsageError, match="is not a cluster environment"):
        detect({"DISTRUN_CLUSTER_ENV": "pbs"})
    with pytest.raises(UsageError, match="variables are missing"):
        detect({"DISTRUN_CLUSTER_ENV": "slurm"})
    with pytest.raises(UsageError, match="SLURM_NTASKS='x'"):
        detect({**SLURM_TASKS, "SLURM_NTASKS": "x"})


ENV_LINES = [  # (environment, the line `distrun env` prints for it)
    ({}, "- Cluster environment: local"),
    (SLURM_TASKS, "- Cluster environment: slurm (nnodes=2, node_rank=1, nproc_per_node=2, "
                  "master_addr=gpu07, master_port=21234, per_process=True, rank=3, local_rank=1, "
                  "world_size=4)"),
    (PYTORCHJOB_OLD, "- Cluster environment: pytorchjob (nnodes=4, node_rank=3, "
                     "master_addr=job-master-0, master_port=23456)"),
    (MPICH, "- Cluster environment: mpi (pmi) (nnodes=1, node_rank=0, nproc_per_node=2, "
            "master_addr=127.0.0.1, master_port=29500, per_process=True, rank=1, local_rank=1, "
            "world_size=2)"),
]


def test_distrun_env_shows_the_detected_environment(h, cli, tmp_path):
    # In-process (the `cli` fixture): `distrun env` needs no process of its own.
    for env, line in ENV_LINES:
        result = cli("env", env=h.cli_env(**env), cwd=tmp_path)
        assert result.returncode == 0, result
        assert line in result.stdout.splitlines(), result.stdout
    # a broken environment is one line and exit 2, no traceback
    broken = cli("env", env=h.cli_env(**{**SLURM_NODES, "SLURM_NODELIST": "n[1-"}), cwd=tmp_path)
    assert broken.returncode == 2
    assert broken.stderr.strip() == "error: bad SLURM node list 'n[1-': unbalanced '['", broken
