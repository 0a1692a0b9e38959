"""Rank facts from each launcher's environment, passed as plain dicts."""

import pytest

from hpcdist.errors import BootstrapError
from hpcdist.runtime.rankinfo import RankInfo

SRUN_RANK5 = {  # srun -N2 --ntasks-per-node=4, task 5
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_ID": "4242",
}


def test_srun() -> None:
    info = RankInfo.from_env(SRUN_RANK5, hostname="gpu08")
    assert (info.launcher, info.rank, info.world_size) == ("slurm", 5, 8)
    assert (info.local_rank, info.local_world_size, info.node_rank, info.num_nodes) == (1, 4, 1, 2)
    assert info.hosts == ("gpu07", "gpu08")
    assert info.job_id == "4242"


def test_srun_uneven_tasks_derives_node_and_local_rank() -> None:
    env = {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "3,2"}
    info = RankInfo.from_env(env, hostname="n2")
    assert (info.node_rank, info.local_rank, info.local_world_size) == (1, 1, 2)


def test_srun_pmix_takes_rank_from_pmix() -> None:
    env = {**SRUN_RANK5, "PMIX_RANK": "5"}
    info = RankInfo.from_env(env, hostname="gpu08")
    assert info.launcher == "pmix"
    assert (info.rank, info.world_size, info.local_rank, info.node_rank) == (5, 8, 1, 1)


def test_openmpi() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": "1",
        "SLURM_PROCID": "1",  # mpirun inside an allocation: Slurm's values are the daemon's
    }
    info = RankInfo.from_env(env, hostname="h")
    assert info.launcher == "openmpi"
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.node_rank) == (3, 4, 1, 2, 1)


def test_mpich_and_intel_mpi() -> None:
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    info = RankInfo.from_env(env, hostname="h")
    assert info.launcher == "mpich"
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (2, 4, 0, 2)


def test_torchrun() -> None:
    env = {
        "TORCHELASTIC_RUN_ID": "abc",
        "RANK": "6",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "SLURM_PROCID": "1",
    }
    info = RankInfo.from_env(env, hostname="h")
    assert info.launcher == "torchrun"
    assert (info.rank, info.world_size, info.local_rank, info.node_rank) == (6, 8, 2, 1)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 29500)


def test_submitit_local() -> None:
    env = {
        "SUBMITIT_LOCAL_JOB_ID": "777",
        "SUBMITIT_LOCAL_GLOBALID": "1",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_LOCALID": "1",
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
    }
    info = RankInfo.from_env(env, hostname="h")
    assert (info.launcher, info.rank, info.world_size, info.local_world_size, info.job_id) == (
        "submitit-local", 1, 2, 2, "777",
    )


def test_single_process() -> None:
    info = RankInfo.from_env({}, hostname="h")
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.num_nodes) == ("single", 0, 1, 0, 1)


def test_slurm_node_name_is_the_hostname() -> None:
    info = RankInfo.from_env({**SRUN_RANK5, "SLURMD_NODENAME": "gpu08"})
    assert info.hostname == "gpu08"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "rank 4 is outside world size 4"),
        ({"SLURM_PROCID": "x", "SLURM_NTASKS": "4"}, "SLURM_PROCID='x' is not an integer"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2(y2)"}, "bad tasks-per-node"),
    ],
)
def test_inconsistent_launch_is_an_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(BootstrapError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RankInfo.from_env(env, hostname="h")


def test_openmpi_node_comes_from_the_hosts_not_node_rank() -> None:
    # OMPI_COMM_WORLD_NODE_RANK is the rank within the node: it is never the node index
    base = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    rank2 = {**base, "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_NODE_RANK": "0"}
    # outside Slurm: no node list, so block placement until the ranks check in; two nodes, not one
    info = RankInfo.from_env(rank2, hostname="n2")
    assert (info.node_rank, info.num_nodes, info.single_host) == (1, 2, False)
    placed = info.placed({0: "n1", 1: "n1", 2: "n2", 3: "n2"})
    assert (placed.node_rank, placed.num_nodes) == (1, 2)
    assert info.placed({0: "n2", 1: "n1", 2: "n2", 3: "n1"}).node_rank == 0  # nodes in order of lowest rank
    # inside an allocation: a rank on n2 inherits its Open MPI daemon's one-node srun step
    in_job = {**rank2, "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0",
              "SLURM_STEP_NODELIST": "n2", "SLURM_STEP_NUM_NODES": "1", "SLURM_JOB_ID": "7"}
    info = RankInfo.from_env(in_job, hostname="n2")
    assert (info.node_rank, info.num_nodes, info.hosts, info.job_id) == (1, 2, ("n1", "n2"), "7")
    # one host for every rank: loopback
    alone = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
             "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert RankInfo.from_env(alone, hostname="h").single_host


def test_launcher_given_node_index_is_kept_after_check_in() -> None:
    info = RankInfo.from_env(SRUN_RANK5, hostname="gpu08")
    assert info.placed({r: "gpu07" if r % 2 else "gpu08" for r in range(8)}) is info
