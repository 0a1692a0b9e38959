"""The line between a job's ranks and its in-job supervisor (hpcdist.runtime.in_job_link), without
a cluster: the rank a process started again alone takes, which failures are its communication's,
and what the supervisor reads from a rank. The whole path runs on the real cluster in
tests/test_in_job_restart.py."""

from __future__ import annotations

import socket
import time

from hpcdist.config.contract import IN_PLACE_VAR
from hpcdist.errors import JobError
from hpcdist.runtime import in_job_link
from hpcdist.runtime.in_job_link import Links
from hpcdist.runtime.rankinfo import RankInfo


def test_a_rank_started_again_alone_takes_the_rank_it_replaces() -> None:
    """The second task of a step started for ranks 1 and 3 of a 4-rank job (2 nodes x 2) is rank
    3, the second of node n2, for the bootstrap as for srun --mpi=pmix's variable."""
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "0",
           "SLURM_STEP_NODELIST": "n2", "SLURM_JOB_ID": "7", "PMIX_RANK": "1", IN_PLACE_VAR: "1,3;4;n1,n2;2"}
    in_job_link.adopt(env)
    info = RankInfo.from_env(env, hostname="n2")
    assert (info.rank, info.world_size, info.local_rank, info.node_rank) == (3, 4, 1, 1)
    assert env["PMIX_RANK"] == "3" and env["SLURM_STEP_NODELIST"] == "n1,n2"
    untouched = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    in_job_link.adopt(untouched)  # any other process: as srun started it
    assert untouched == {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}


def test_a_peer_gone_is_a_communication_failure_and_a_bug_is_not() -> None:
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [10.0.0.4]:4711: Connection reset by peer")
    try:
        try:
            raise reset
        except RuntimeError as exc:
            raise JobError("training step 12 (gradient all_reduce) failed on rank 0 (n2)") from exc
    except JobError as wrapped:
        assert in_job_link.communication_failure(wrapped)
    assert in_job_link.communication_failure(RuntimeError("Timed out waiting 10000ms for recv operation"))
    assert not in_job_link.communication_failure(ValueError("batch size 7 does not divide 12"))
    assert not in_job_link.communication_failure(KeyError("w"))


def test_the_supervisor_reads_who_a_rank_is_and_ignores_a_failure_already_answered() -> None:
    """A rank's hello names its step, rank and node (a node outside the step's is ignored); its
    failure counts only in the current run (one of an earlier run was told `again` already)."""
    links = Links("127.0.0.1")
    host, port = links.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as rank, socket.create_connection((host, int(port))) as stray:
        rank.sendall(b"12 2 n4\nfailed comm 0\n")
        stray.sendall(b"12 0 n9\n")  # a node the step does not have
        deadline = time.monotonic() + 5
        while len(links.ranks()) < 1 and time.monotonic() < deadline:
            links.events(0.2, ["n2", "n3", "n4"], restart=1)
        [link] = links.ranks()
        assert (link.rank, link.node, link.failed) == (2, "n4", "")  # run 0's failure: answered by `again 1`
        assert links.steps == {"12"}
        rank.sendall(b"failed own 1\n")
        while not link.failed and time.monotonic() < deadline:
            links.events(0.2, ["n2", "n3", "n4"], restart=1)
        assert link.failed == "own"
        links.tell("stop")
        assert rank.recv(64) == b"stop\n" and link.failed == ""
    links.close_all()
