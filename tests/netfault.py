"""Network and node faults on one node of the local Slurm cluster, for tests: a slowed link, a
cut link, a dead node.

All are context managers that always restore the node on the way out, even when the test fails
inside. They drive cluster/netfault.sh and cluster/nodefault.sh, which own the names of the
nodes' namespaces and veths; they need the cluster in netns mode (`cluster_mode()` says which
mode it runs in).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NETFAULT = REPO / "cluster" / "netfault.sh"
NODEFAULT = REPO / "cluster" / "nodefault.sh"
STATE = Path(os.environ.get("HPCDIST_SLURM_STATE", "/var/tmp/hpcdist-slurm"))


def cluster_mode() -> str:
    """What cluster/up.sh recorded: "netns", "single-host: <why>", or "down"."""
    try:
        return (STATE / "mode").read_text().strip() or "down"
    except FileNotFoundError:
        return "down (no mode file; run make cluster-up)"


def _netfault(*args: str, script: Path = NETFAULT) -> None:
    proc = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"cluster/{script.name} {' '.join(args)} failed: {proc.stderr.strip()}")


def restore(node: str) -> None:
    """The node's link as cluster/up.sh made it: up, no rate limit."""
    _netfault("restore", node)


@contextmanager
def slowed(node: str, rate: str = "8mbit") -> Iterator[None]:
    """The node's link rate-limited both ways (tc tbf) inside the block."""
    try:
        _netfault("slow", node, rate)
        yield
    finally:
        restore(node)


@contextmanager
def cut(node: str) -> Iterator[None]:
    """The node's link down inside the block: nothing reaches the node or leaves it."""
    try:
        _netfault("cut", node)
        yield
    finally:
        restore(node)


@contextmanager
def controller_refused(node: str) -> Iterator[None]:
    """The Slurm controller's port refused from the node inside the block (a TCP reset: what the
    node sees while slurmctld restarts or fails over); open again on the way out."""
    try:
        _netfault("controller", node, "off")
        yield
    finally:
        _netfault("controller", node, "on")


def on_node(node: str, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[str]:
    """Start ARGV in the node's network namespace (outside Slurm), e.g. to measure its link."""
    return subprocess.Popen([str(NETFAULT), "exec", node, *argv], text=True, **kwargs)  # type: ignore[call-overload]


def revive(node: str) -> None:
    """The node back in service (link up, slurmd started, resumed in Slurm; idle once it returns)."""
    _netfault("revive", node, script=NODEFAULT)


@contextmanager
def killed(node: str) -> Iterator[None]:
    """The node dead inside the block, as hardware dies: link cut, slurmd and every process in it
    killed; Slurm declares it DOWN after SlurmdTimeout. Revived on the way out."""
    try:
        _netfault("kill", node, script=NODEFAULT)
        yield
    finally:
        revive(node)
