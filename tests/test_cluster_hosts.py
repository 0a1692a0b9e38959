"""The local Slurm cluster's nodes are separate hosts (cluster/up.sh's netns mode): own hostname,
own address, names that resolve everywhere, no route off the test network; the fault helper
slows and cuts one node's link; the smoke job spans both nodes under every launcher (srun,
srun + PMIx, mpirun, torchrun), and mpirun spans them with no Slurm at all."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from hpcdist.store.results import read_attrs
from tests.netfault import cut, on_node, restore, slowed
from tests.support.cli import job_id, result_path, run_cli, sacct_state, storage_sets

NODES = ("n1", "n2")
TEST_NET = ipaddress.ip_network("10.251.0.0/24")  # cluster/lib.sh NET_PREFIX / NET_BITS


def srun(*argv: str, timeout: float = 60) -> list[str]:
    """One task on each of n1 and n2 (the nodes these tests name, cut and slow); the output lines
    sorted (so n1's come first)."""
    proc = subprocess.run(["srun", "-N2", "-n2", "-w", ",".join(NODES), "-t", "1", *argv], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sorted(proc.stdout.splitlines())


def test_each_node_has_its_own_hostname_and_address(separate_hosts: Path) -> None:
    lines = srun("sh", "-c", 'echo "$(hostname) $SLURMD_NODENAME $(hostname -I)"')
    rows = [line.split() for line in lines]
    assert [r[:2] for r in rows] == [["n1", "n1"], ["n2", "n2"]], lines
    addrs = [ipaddress.ip_address(r[2]) for r in rows]
    assert all(len(r) == 3 for r in rows), lines  # one address per node (loopback not listed)
    assert addrs[0] != addrs[1] and all(a in TEST_NET for a in addrs), lines


def test_node_names_resolve_on_the_login_side_and_in_a_job(separate_hosts: Path) -> None:
    login = {n: socket.gethostbyname(n) for n in NODES}
    assert len(set(login.values())) == 2 and all(ipaddress.ip_address(a) in TEST_NET for a in login.values())
    for line in srun("getent", "ahostsv4", "n1"):  # both nodes see n1 where the login side does
        assert line.startswith(login["n1"]), line
    own = srun("sh", "-c", 'echo "$(hostname) $(getent hosts "$(hostname)" | cut -d" " -f1)"')
    assert own == [f"{n} {login[n]}" for n in NODES]


def test_nodes_have_no_route_off_the_test_network(separate_hosts: Path) -> None:
    assert srun("ip", "route", "show", "default") == []
    # 192.0.2.1 stands for any address outside the test network (a documentation address).
    lines = srun("sh", "-c", 'ip route get 192.0.2.1 2>&1; echo "exit $?"')
    assert lines == ["RTNETLINK answers: Network is unreachable"] * 2 + ["exit 2"] * 2, lines


# A receiver on n1 and a sender on n2, outside Slurm, in the nodes' network namespaces.
RECEIVER = """
import socket, sys
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
conn, _ = srv.accept()
while conn.recv(1 << 16):
    pass
conn.sendall(b"done")
"""
SENDER = """
import socket, sys, time
size, t0 = int(sys.argv[3]), time.monotonic()
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4])) as s:
    s.sendall(b"x" * size)
    s.shutdown(socket.SHUT_WR)
    assert s.recv(4) == b"done"
print(time.monotonic() - t0)
"""


def transfer_s(n1_addr: str, size: int, timeout: float = 20) -> float:
    """Seconds to send `size` bytes from n2 to n1 and hear back that they arrived."""
    port = 23000 + os.getpid() % 1000
    receiver = on_node("n1", [sys.executable, "-c", RECEIVER, str(port)], stdout=subprocess.PIPE)
    try:
        assert receiver.stdout is not None and receiver.stdout.readline().strip() == "ready"
        sender = on_node("n2", [sys.executable, "-c", SENDER, n1_addr, str(port), str(size), str(timeout)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = sender.communicate(timeout=timeout + 10)
        if sender.returncode != 0:
            raise ConnectionError(err.strip().splitlines()[-1] if err.strip() else f"exit {sender.returncode}")
        return float(out)
    finally:
        receiver.kill()
        receiver.wait()


def test_slowed_link_slows_a_transfer_and_is_restored(separate_hosts: Path) -> None:
    n1 = socket.gethostbyname("n1")
    size = 1_000_000
    before = transfer_s(n1, size)
    with slowed("n2", rate="4mbit"):  # 0.5 MB/s: about 2 s for 1 MB
        during = transfer_s(n1, size)
    after = transfer_s(n1, size)
    assert during > 1.2, (before, during, after)
    assert before < 0.5 and after < 0.5, (before, during, after)
    assert "tbf" not in subprocess.run(["cluster/netfault.sh", "show", "n2"], capture_output=True, text=True).stdout


def test_cut_link_fails_connections_and_is_restored(separate_hosts: Path) -> None:
    n1 = socket.gethostbyname("n1")
    with cut("n2"):
        t0 = time.monotonic()
        with pytest.raises(ConnectionError):
            transfer_s(n1, 1000, timeout=3)
        assert time.monotonic() - t0 < 15
    assert transfer_s(n1, 1000) < 1
    # a test that fails inside the block still gets its link back
    with pytest.raises(RuntimeError, match="boom"), cut("n2"):
        raise RuntimeError("boom")
    assert transfer_s(n1, 1000) < 1
    assert srun("hostname") == ["n1", "n2"]  # slurmd on n2 still answers
    restore("n2")  # idempotent


# (launcher overrides, MPI inside the job): srun without and with PMIx, mpirun in the allocation.
LAUNCHERS = {
    "srun": (["--set", "site.launcher.args=[]"], False),
    "srun-pmix": ([], True),
    "mpirun": (["--set", "site.launcher.kind=mpirun", "--set", "site.launcher.args=[]"], True),
    "torchrun": (["--set", "site.launcher.kind=torchrun", "--set", "site.launcher.args=[]"], False),
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_smoke_spans_both_hosts(separate_hosts: Path, launcher: str) -> None:
    overrides, mpi = LAUNCHERS[launcher]
    # The cluster runs jobs as root, which Open MPI's mpirun refuses without these (sbatch passes
    # the submitting environment on to the job).
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    result = run_cli(
        "submit", "jobs/smoke.yaml", "--site", "local-slurm", "--wait",
        "--set", "resources.nodes=2", "--set", "sbatch.nodelist=n1,n2", "--set", "resources.tasks_per_node=2",
        "--set", f"params.mpi={str(mpi).lower()}",
        *overrides, *storage_sets(separate_hosts), env=env,
    )
    assert result.code == 0, result.text
    jid = job_id(result.out)
    assert f"job {jid} finished: COMPLETED; 4/4 ranks succeeded" in result.out
    assert sacct_state(jid) == "COMPLETED"
    attrs = read_attrs(result_path(result.out))
    assert attrs["hosts"] == ["n1", "n1", "n2", "n2"] and attrs["num_nodes"] == 2
    with h5py.File(result_path(result.out)) as f:
        assert f.attrs["sum"] == 6.0
    # every rank knows its node: n2's ranks say node 1 of 2 (Open MPI's NODE_RANK is not the node)
    logs = sorted((separate_hosts / "logs" / "smoke").glob("*/*_log.err"))
    ready = set(re.findall(r"\(local \d/2, node (\d/\d)\) on (n\d)", "".join(p.read_text() for p in logs)))
    assert ready == {("0/2", "n1"), ("1/2", "n2")}, ready
    if mpi:
        assert result.out.count('"mpi_sum": 6') == 4
    # rank 0 published its address on network.socket_ifname: n1's, which every rank used
    log = next((separate_hosts / "logs" / "smoke").glob("*/*_0_log.err")).read_text()
    endpoints = set(re.findall(r"endpoint ([\d.]+):\d+", log))
    assert endpoints == {socket.gethostbyname("n1")}, log[-2000:]


def mpirun_smoke(storage: Path, hosts: str, ranks: int, *sets: str,
                 timeout: float = 150) -> subprocess.CompletedProcess[str]:
    """The smoke job under `mpirun -H HOSTS -n RANKS` with no Slurm at all: Open MPI starts its
    daemons on the nodes through a remote-shell agent (tests/node_rsh.sh stands in for ssh, which
    the nodes lack). `sets`: more ``--set`` arguments."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "HPCDIST_RUN_ID": storage.name}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    return subprocess.run(
        ["mpirun", "--mca", "plm_rsh_agent", str(Path(__file__).with_name("node_rsh.sh")), "--mca", "routed", "direct",
         "-x", "PYTHONPATH", "-x", "HPCDIST_RUN_ID", "-H", hosts, "-n", str(ranks),
         sys.executable, "-m", "hpcdist.runtime.entry", "jobs/smoke.yaml", "--site", "local-slurm",
         "--set", "resources.nodes=2", "--set", "params.mpi=true", *sets, *storage_sets(storage)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=Path(__file__).resolve().parents[1],
    )


def test_mpirun_outside_slurm_spans_both_hosts(separate_hosts: Path) -> None:
    """`mpirun -H n1:2,n2:2` with no Slurm at all: the node index comes from the hosts, so rank 0
    publishes n1's address, not loopback."""
    proc = mpirun_smoke(separate_hosts, "n1:2,n2:2", 4)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "'sum': 6.0" in proc.stdout and "'mpi_sum': 6" in proc.stdout, proc.stdout
    ready = re.findall(r"rank (\d)/4 \(local \d/2, node (\d)/(\d)\) on (n\d) via openmpi, .* endpoint ([\d.]+):",
                       proc.stderr)
    assert sorted(ready) == [("0", "0", "2", "n1", "10.251.0.11"), ("1", "0", "2", "n1", "10.251.0.11"),
                             ("2", "1", "2", "n2", "10.251.0.11"), ("3", "1", "2", "n2", "10.251.0.11")], proc.stderr


def test_mpi_rendezvous_ends_when_rank0_fails_before_its_endpoint(separate_hosts: Path) -> None:
    """Rank 0 on n1 cannot publish an endpoint (no such interface): it sends its error over MPI
    instead, so rank 1 on n2 fails at once naming rank 0's cause (it waited in bcast forever)."""
    t0 = time.monotonic()
    try:
        proc = mpirun_smoke(separate_hosts, "n1:1,n2:1", 2, "--set", "resources.tasks_per_node=1",
                            "--set", "site.network.socket_ifname=nope0", "--set", "site.defaults.timeout_s=60",
                            timeout=100)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpirun still running after {exc.timeout:g} s: rank 1 waits for an endpoint that never comes")
    took = time.monotonic() - t0
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "network.socket_ifname 'nope0' has no IPv4 address on n1" in proc.stderr, proc.stderr[-3000:]
    assert ("rendezvous: rank 0 on n1 failed before publishing its endpoint (BootstrapError: network.socket_ifname "
            "'nope0' has no IPv4 address on n1") in proc.stderr, proc.stderr[-3000:]
    assert "this is rank 1 on n2" in proc.stderr, proc.stderr[-3000:]
    assert took < 45, took  # well inside the 60 s rendezvous timeout: nobody waited it out
