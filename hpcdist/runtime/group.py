"""From rank facts to a torch.distributed process group, with no hang and no name lookup.

Rank 0 opens a TCPStore on a free port (so two jobs sharing a node never collide) and
publishes ``address:port``: over MPI when mpi4py is up, else in a file on shared storage, else
(no shared directory) on the first host of the node list with a port derived from the job id.
Every rank then checks in; a rank that does not arrive within the timeout is named in the error
that every other rank raises.
"""

from __future__ import annotations

import json
import os
import socket
import zlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.config.site import SOCKET_IFNAME_VARS
from hpcdist.errors import BootstrapError
from hpcdist.polling import poll_until
from hpcdist.runtime.rankinfo import RankInfo
from hpcdist.store.atomic import atomic_path

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

_POLL_S = 0.05


@dataclass(frozen=True)
class Endpoint:
    addr: str
    port: int
    via: str  # how the ranks learnt it: env, mpi, file, hostlist


def own_address(ifname: str | None, single_node: bool) -> str:
    """An IPv4 address of this host that the other ranks can reach."""
    if single_node:
        return "127.0.0.1"
    if ifname:
        return _interface_address(ifname)
    return socket.gethostbyname(socket.gethostname())


def socket_ifname_env(ifname: str | None) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for the site's ``network.socket_ifname``: the
    interface rank 0 publishes its address on is the one the collectives use (set here only,
    by the bootstrap, so a direct launch gets them as a submitted job does)."""
    return dict.fromkeys(SOCKET_IFNAME_VARS, ifname) if ifname else {}


def _interface_address(ifname: str) -> str:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))
        except OSError as exc:
            raise BootstrapError(
                f"network.socket_ifname {ifname!r} has no IPv4 address on {socket.gethostname()} "
                f"({exc.strerror}); set it to an interface listed by `ip addr`"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def rendezvous_key(env: dict[str, str] | os._Environ[str], info: RankInfo) -> str:
    """A name unique to this launch: job, step and restart, so a requeued job never reads a stale file."""
    parts = [
        info.job_id or env.get("HPCDIST_RUN_ID", "") or "nojob",
        env.get("SLURM_STEP_ID", "0"),
        env.get("SLURM_RESTART_COUNT", "0"),
        env.get("TORCHELASTIC_RESTART_COUNT", "0"),
    ]
    return ".".join(p.replace(os.sep, "_") for p in parts)


def _store(addr: str, port: int, info: RankInfo, timeout: float, is_master: bool) -> dist.TCPStore:
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            addr,
            port,
            None,
            is_master,
            timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    except Exception as exc:  # torch raises DistNetworkError / RuntimeError variants
        if is_master:
            raise BootstrapError(f"rendezvous: rank 0 cannot listen on {addr}:{port}: {exc}") from exc
        raise BootstrapError(
            f"rendezvous: rank {info.rank} could not reach rank 0 at {addr}:{port} within "
            f"{timeout:g} s ({type(exc).__name__}); rank 0 may have died or never started"
        ) from exc


def open_store(
    info: RankInfo,
    timeout: float,
    *,
    rendezvous_dir: Path | None,
    key: str,
    mpi_comm: Any = None,
    ifname: str | None = None,
) -> tuple[dist.Store, Endpoint]:
    """The job's shared TCPStore, with rank 0 as the server, and how its address was learnt."""
    single_node = info.single_host
    if info.master_addr and info.master_port:
        # A launcher's agent may already serve a store there (torchrun: every rank is a client);
        # a hand-set env:// endpoint is served by rank 0.
        is_master = info.is_main and not info.agent_store
        store = _store(info.master_addr, info.master_port, info, timeout, is_master)
        return _prefixed(store, key), Endpoint(info.master_addr, info.master_port, "env")
    if mpi_comm is not None:
        server = None
        published: Endpoint | None = None
        if info.is_main:
            addr = own_address(ifname, single_node)
            server = _store(addr, 0, info, timeout, True)
            published = Endpoint(addr, server.port, "mpi")
        published = mpi_comm.bcast(published, root=0)
        assert published is not None
        client = server or _store(published.addr, published.port, info, timeout, False)
        return _prefixed(client, key), published
    if rendezvous_dir is not None:
        path = rendezvous_dir / f"{key}.json"
        if info.is_main:
            addr = own_address(ifname, single_node)
            store = _store(addr, 0, info, timeout, True)
            rendezvous_dir.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                tmp.write_text(json.dumps({"addr": addr, "port": store.port, "host": info.hostname}))
            return _prefixed(store, key), Endpoint(addr, store.port, "file")
        found = _wait_for_file(path, timeout, info)
        endpoint = Endpoint(found["addr"], int(found["port"]), "file")
        return _prefixed(_store(endpoint.addr, endpoint.port, info, timeout, False), key), endpoint
    if not info.hosts and not single_node:
        raise BootstrapError(
            "rendezvous: no MPI, no shared rendezvous directory and no node list; "
            "set storage.scratch in the site config or launch with srun"
        )
    addr = "127.0.0.1" if single_node else _resolve(info.hosts[0])
    port = 20000 + zlib.crc32(key.encode()) % 20000
    store = _store(addr, port, info, timeout, info.is_main)
    return _prefixed(store, key), Endpoint(addr, port, "hostlist")


def _prefixed(store: dist.Store, key: str) -> dist.Store:
    """Keys of this launch only: a torchrun restart or a requeue starts on a clean namespace."""
    import torch.distributed as dist

    return dist.PrefixStore(f"hpcdist/{key}", store)


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        raise BootstrapError(
            f"rendezvous: first host {host!r} does not resolve and no other way to find rank 0 "
            f"was available; set storage.scratch on shared storage or launch with MPI"
        ) from None


def _wait_for_file(path: Path, timeout: float, info: RankInfo) -> dict[str, Any]:
    found = poll_until(lambda: _read_endpoint(path), timeout, _POLL_S)
    if found is None:
        raise BootstrapError(
            f"rendezvous: rank 0 did not publish its address in {path} within {timeout:g} s "
            f"(waiting rank {info.rank} on {info.hostname}); rank 0 died or never started"
        )
    return found


def _read_endpoint(path: Path) -> dict[str, Any] | None:
    """The published endpoint, or None while rank 0 has not written it (atomically) yet."""
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def check_in(store: dist.Store, info: RankInfo, timeout: float) -> dict[int, str]:
    """Every rank announces itself and waits for all others; returns rank -> host.

    A rank missing after `timeout` is named in the error every waiting rank raises.
    """
    store.set(f"hpcdist/join/{info.rank}", info.hostname)
    keys = [f"hpcdist/join/{r}" for r in range(info.world_size)]
    missing = list(range(info.world_size))

    def all_joined() -> bool | None:
        nonlocal missing
        try:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
        except Exception as exc:  # rank 0 (the store's server) gave up or died
            raise BootstrapError(
                f"rendezvous: rank(s) {_ranks(missing)} of {info.world_size} had not joined when rank 0's "
                f"store closed (this is rank {info.rank} on {info.hostname}; {type(exc).__name__}); "
                f"see the missing rank's log"
            ) from None
        return True if not missing else None

    if poll_until(all_joined, timeout, _POLL_S) is None:
        raise BootstrapError(
            f"rendezvous: rank(s) {_ranks(missing)} of {info.world_size} did not join within "
            f"{timeout:g} s (this is rank {info.rank} on {info.hostname}); the missing rank "
            f"died or was never started: see its log"
        )
    return {r: store.get(k).decode() for r, k in enumerate(keys)}


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def init_process_group(
    store: dist.Store, info: RankInfo, backend: str, timeout: float, device: torch.device | None = None
) -> None:
    """torch.distributed's default group over `store`; under NCCL bound to `device`, the rank's
    device as ``hpcdist.runtime.device`` chose it (the bootstrap's), never re-derived here."""
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        if device is None or device.type != "cuda":
            raise BootstrapError(f"rank {info.rank}: the nccl backend needs this rank's CUDA device, got {device}")
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore("pg", store),
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=timeout),
        **kwargs,
    )


def finish(store: dist.Store, info: RankInfo, timeout: float) -> None:
    """A last check-out so rank 0 (the store's server) leaves only after every rank is done."""
    store.set(f"hpcdist/done/{info.rank}", "1")
    if info.is_main:
        keys = [f"hpcdist/done/{r}" for r in range(info.world_size)]
        # Past the timeout rank 0 leaves anyway: the job's work is done, only the farewell is late.
        poll_until(lambda: True if all(store.check([k]) for k in keys) else None, timeout, _POLL_S)
