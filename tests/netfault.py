"""Network faults on one node of the local Slurm cluster, for tests: a slowed link, a cut link.

Both are context managers that always restore the link on the way out, even when the test
fails inside. They drive cluster/netfault.sh, which owns the names of the nodes' namespaces and
veths; they need the cluster in netns mode (`cluster_mode()` says which mode it runs in).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NETFAULT = REPO / "cluster" / "netfault.sh"
STATE = Path(os.environ.get("HPCDIST_SLURM_STATE", "/var/tmp/hpcdist-slurm"))


def cluster_mode() -> str:
    """What cluster/up.sh recorded: "netns", "single-host: <why>", or "down"."""
    try:
        return (STATE / "mode").read_text().strip() or "down"
    except FileNotFoundError:
        return "down (no mode file; run make cluster-up)"


def _netfault(*args: str) -> None:
    proc = subprocess.run([str(NETFAULT), *args], capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"cluster/netfault.sh {' '.join(args)} failed: {proc.stderr.strip()}")


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


def on_node(node: str, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[str]:
    """Start ARGV in the node's network namespace (outside Slurm), e.g. to measure its link."""
    return subprocess.Popen([str(NETFAULT), "exec", node, *argv], text=True, **kwargs)  # type: ignore[call-overload]
