"""What a node looks like to the bootstrap: launcher, ranks, GPUs, MPI, InfiniBand (for `hpcdist env`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from hpcdist.errors import HpcdistError
from hpcdist.runtime.rankinfo import RankInfo

IB_ROOT = Path("/sys/class/infiniband")


@dataclass(frozen=True)
class IBPort:
    device: str
    port: int
    state: str
    link_layer: str
    rate: str  # as the kernel says it, e.g. "200 Gb/sec (4X HDR)"

    @property
    def rate_gbps(self) -> float | None:
        head = self.rate.split(" ", 1)[0]
        try:
            return float(head)
        except ValueError:
            return None


def ib_ports(root: Path = IB_ROOT) -> list[IBPort]:
    """InfiniBand ports from sysfs; empty where there is none (recorded, never required)."""
    out: list[IBPort] = []
    if not root.is_dir():
        return out

    def read(p: Path) -> str:
        try:
            return p.read_text().strip()
        except OSError:
            return "unknown"

    for dev in sorted(root.iterdir()):
        ports = dev / "ports"
        if not ports.is_dir():
            continue
        for port in sorted(ports.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
            out.append(
                IBPort(
                    device=dev.name,
                    port=int(port.name) if port.name.isdigit() else 0,
                    state=read(port / "state").split(":")[-1].strip(),
                    link_layer=read(port / "link_layer"),
                    rate=read(port / "rate"),
                )
            )
    return out


def describe(env: dict[str, str]) -> str:
    lines = [f"host: {socket.gethostname()}"]
    try:
        info = RankInfo.from_env(env)
        lines.append(f"launcher: {info.launcher}")
        lines.append(f"rank: {info.describe()}")
        lines.append(f"hosts: {', '.join(info.hosts) or '(no node list)'}")
        lines.append(f"job id: {info.job_id or '(none)'}")
        if info.master_addr:
            lines.append(f"master: {info.master_addr}:{info.master_port}")
    except HpcdistError as exc:
        lines.append(f"launcher: cannot read rank facts: {exc}")
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        lines.append(f"torch: {torch.__version__}, CUDA {'available' if gpus else 'not available'}, {gpus} GPU(s)")
        for i in range(gpus):
            lines.append(f"  gpu {i}: {torch.cuda.get_device_name(i)}")
        dist = torch.distributed
        lines.append(
            f"backends: gloo {dist.is_gloo_available()}, nccl {dist.is_nccl_available()}, "
            f"mpi {dist.is_mpi_available()}"
        )
    except ImportError:
        lines.append("torch: not installed")
    try:
        import mpi4py

        lines.append(f"mpi4py: {mpi4py.__version__} (MPI not initialised by `hpcdist env`)")
    except ImportError:
        lines.append("mpi4py: not installed")
    lines.append(f"CUDA_VISIBLE_DEVICES: {env.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
    ports = ib_ports()
    if ports:
        for p in ports:
            lines.append(f"infiniband: {p.device} port {p.port}: {p.state}, {p.link_layer}, {p.rate}")
    else:
        lines.append("infiniband: none found in /sys/class/infiniband")
    for key in sorted(k for k in env if k.startswith(("NCCL_", "UCX_", "GLOO_", "OMP_"))):
        lines.append(f"{key}={env[key]}")
    lines.append(f"cpus available: {len(os.sched_getaffinity(0))}")
    return "\n".join(lines)
