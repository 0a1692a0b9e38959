"""From rank facts to a torch.distributed process group, with no hang and no name lookup.

Rank 0 opens a TCPStore on a free port (so two jobs sharing a node never collide), listening on
the published address only, and publishes ``address:port``: over MPI when mpi4py is up (or its
error, so no rank waits for an endpoint that will never come), else in a file on shared storage,
else (no shared directory) on the first host of the node list with a port derived from the job id.
hpcdist's own messages in the store are signed (``hpcdist.runtime.signed_store``): with the job's
key file, or a key rank 0 sends with its endpoint.
Every rank then checks in (``checkin``: a few requests and bytes per rank whatever the world
size) and, at the end, checks out (``checkout``); both are re-exported here. Every wait here has
the job's finite timeout.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist.config.contract import IN_JOB_RESTART_VAR, LAUNCH_ID_VAR
from hpcdist.config.site import SOCKET_IFNAME_VARS, under
from hpcdist.errors import BootstrapError, cause_text
from hpcdist.files.atomic import atomic_path
from hpcdist.polling import poll_until
from hpcdist.runtime import abort, signed_store
from hpcdist.runtime.checkin import check_in as check_in
from hpcdist.runtime.checkin import place_gpus as place_gpus
from hpcdist.runtime.checkin import take_seats
from hpcdist.runtime.checkout import BEAT_WATCH_S as BEAT_WATCH_S
from hpcdist.runtime.checkout import beat as beat
from hpcdist.runtime.checkout import check_out as check_out
from hpcdist.runtime.checkout import finish as finish
from hpcdist.runtime.checkout import watch_beat as watch_beat
from hpcdist.runtime.rankinfo import RankInfo

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    Store = signed_store.SignedStore | dist.Store  # hpcdist's messages: signed in a job, plain in tests

_POLL_S = 0.05
_MPI_MESSAGE_BYTES = 4096  # rank 0's endpoint or error (600 characters at most: 6 bytes each escaped), as JSON
log = logging.getLogger("hpcdist")


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
            ) from exc
    return socket.inet_ntoa(packed[20:24])


def rendezvous_key(env: dict[str, str] | os._Environ[str], info: RankInfo) -> str:
    """A name unique to this launch: job, step and restart, so a requeued job never reads a stale
    file; plus the launch id where the job id alone is not unique (the local site's job id is its
    controller's PID, which the system reuses)."""
    parts = [
        info.job_id or env.get("HPCDIST_RUN_ID", "") or env.get("PMIX_NAMESPACE", "") or "nojob",
        *([env[LAUNCH_ID_VAR]] if env.get(LAUNCH_ID_VAR) else []),
        # a job with spares: its restart number in place of the step (ranks started again in place are in two steps)
        f"j{env[IN_JOB_RESTART_VAR]}" if env.get(IN_JOB_RESTART_VAR) else env.get("SLURM_STEP_ID", "0"),
        env.get("SLURM_RESTART_COUNT", "0"),
        env.get("TORCHELASTIC_RESTART_COUNT", "0"),
    ]
    return ".".join(p.replace(os.sep, "_") for p in parts)


def endpoint_file(rendezvous_dir: Path, key: str) -> Path:
    """Where rank 0 publishes its endpoint for the launch `key` (never outside `rendezvous_dir`)."""
    return under(rendezvous_dir, f"{key}.json")


def forget_endpoint(rendezvous_dir: Path | None, key: str, info: RankInfo) -> None:
    """Rank 0 removes the endpoint file once every rank has checked in: no later launch can
    read it, and the rendezvous folder does not grow with every job."""
    if rendezvous_dir is not None and info.is_main:
        endpoint_file(rendezvous_dir, key).unlink(missing_ok=True)


def _listener(addr: str, port: int) -> int | None:
    """A socket listening on `addr` only (not every interface, as torch's own server does), handed
    to the store as an open descriptor; None when `addr` is not an IPv4 address of this host."""
    try:
        socket.inet_aton(addr)
    except OSError:
        return None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        if port:  # a fixed port taken: torch's own bind says so in the usual words
            return None
        raise
    return sock.detach()  # the store owns the descriptor from here on


def _store(addr: str, port: int, info: RankInfo, timeout: float, is_master: bool,
           listen_all: bool = False) -> dist.TCPStore:
    """A client of `addr:port`, or with `is_master` its server, listening on `addr` only (every
    interface with `listen_all`: the host-list fallback, whose name may resolve to another
    address here than on the other nodes)."""
    import torch.distributed as dist

    try:
        fd = _listener(addr, port) if is_master and not listen_all else None
        return dist.TCPStore(
            addr,
            port,
            None,
            is_master,
            timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except Exception as exc:  # torch raises DistNetworkError / RuntimeError variants
        if is_master:
            raise BootstrapError(f"rendezvous: rank 0 cannot listen on {addr}:{port}: {cause_text(exc)}") from exc
        raise BootstrapError(
            f"rendezvous: rank {info.rank} could not reach rank 0 at {addr}:{port} within "
            f"{timeout:g} s ({cause_text(exc)}); rank 0 may have died or never started"
        ) from exc


def open_store(
    info: RankInfo,
    timeout: float,
    *,
    rendezvous_dir: Path | None,
    key: str,
    mpi_comm: Any = None,
    ifname: str | None = None,
    key_file: Path | None = None,
) -> tuple[signed_store.SignedStore, Endpoint]:
    """The job's shared TCPStore, with rank 0 as the server, and how its address was learnt;
    hpcdist's messages in it signed with the job's `key_file` or rank 0's key (``signed_store``)."""
    single_node = info.single_host
    if info.master_addr and info.master_port:
        # A launcher's agent may already serve a store there (torchrun: every rank is a client);
        # a hand-set env:// endpoint is served by rank 0.
        is_master = info.is_main and not info.agent_store
        store = _store(info.master_addr, info.master_port, info, timeout, is_master)
        return _prefixed(store, key, signed_store.alone(key_file, "env")), Endpoint(info.master_addr,
                                                                                   info.master_port, "env")
    if mpi_comm is not None:
        return _mpi_rendezvous(mpi_comm, info, timeout, key, ifname, key_file)
    if rendezvous_dir is not None:
        path = endpoint_file(rendezvous_dir, key)
        if info.is_main:
            addr = own_address(ifname, single_node)
            store = _store(addr, 0, info, timeout, True)
            secret, share = signed_store.for_rank0(key_file)
            _private(rendezvous_dir)
            with atomic_path(path, mode=0o600) as tmp:  # the owner's ranks only: it opens the job's store
                tmp.write_text(json.dumps({"addr": addr, "port": store.port, "host": info.hostname, **share}))
            return _prefixed(store, key, secret), Endpoint(addr, store.port, "file")
        found = _wait_for_file(path, timeout, info)
        if found.get("refused"):
            raise BootstrapError(f"rendezvous: rank {info.rank} on {info.hostname} refuses the endpoint: "
                                 f"{found['refused']}")
        endpoint = Endpoint(found["addr"], int(found["port"]), "file")
        store = _store(endpoint.addr, endpoint.port, info, timeout, False)
        return _prefixed(store, key, signed_store.from_rank0(found, key_file, timeout, info.rank)), endpoint
    if not info.hosts and not single_node:
        raise BootstrapError(
            "rendezvous: no MPI, no shared rendezvous directory and no node list; "
            "set storage.scratch in the site config or launch with srun"
        )
    addr = "127.0.0.1" if single_node else _resolve(info.hosts[0])
    port = 20000 + zlib.crc32(key.encode()) % 20000
    store = _store(addr, port, info, timeout, info.is_main, listen_all=not single_node)
    return _prefixed(store, key, signed_store.alone(key_file, "hostlist")), Endpoint(addr, port, "hostlist")


def _mpi_rendezvous(
    comm: Any, info: RankInfo, timeout: float, key: str, ifname: str | None, key_file: Path | None
) -> tuple[signed_store.SignedStore, Endpoint]:
    """Rank 0 serves the store and sends every rank its endpoint, or its error, over MPI."""
    if not info.is_main:
        got = _mpi_share(comm, None, info, timeout)
        if "error" in got:
            raise BootstrapError(
                f"rendezvous: rank 0 on {got.get('host', '?')} failed before publishing its endpoint "
                f"({got['error']}); this is rank {info.rank} on {info.hostname}: see rank 0's log"
            )
        endpoint = Endpoint(str(got["addr"]), int(got["port"]), "mpi")
        store = _store(endpoint.addr, endpoint.port, info, timeout, False)
        return _prefixed(store, key, signed_store.from_rank0(got, key_file, timeout, info.rank)), endpoint
    try:
        addr = own_address(ifname, info.single_host)
        server = _store(addr, 0, info, timeout, True)
    except BaseException as exc:
        _mpi_share(comm, {"error": cause_text(exc)[:500], "host": info.hostname[:100]}, info, timeout)
        raise
    secret, share = signed_store.for_rank0(key_file)
    _mpi_share(comm, {"addr": addr, "port": server.port, **share}, info, timeout)
    return _prefixed(server, key, secret), Endpoint(addr, server.port, "mpi")


def _mpi_share(comm: Any, message: dict[str, Any] | None, info: RankInfo, timeout: float) -> dict[str, Any]:
    """Rank 0's `message` on every rank (a non-blocking broadcast polled against `timeout`).

    A broadcast that does not complete in time cannot be cancelled, and a process left inside
    it would hang in MPI_Finalize: the error is logged and the whole MPI job is aborted.
    """
    from mpi4py import MPI

    buf = bytearray(_MPI_MESSAGE_BYTES)
    if message is not None:
        data = json.dumps(message).encode()
        buf[: len(data)] = data
    request = comm.Ibcast([buf, MPI.BYTE], root=0)
    if poll_until(lambda: True if request.Test() else None, timeout, _POLL_S) is None:
        log.error(
            "rendezvous: no endpoint from rank 0 over MPI within %g s (this is rank %d on %s); rank 0 is "
            "stuck or gone; aborting the MPI job", timeout, info.rank, info.hostname,
        )
        logging.shutdown()
        comm.Abort(1)
    return dict(json.loads(bytes(buf).rstrip(b"\0")))


def _prefixed(store: dist.Store, key: str, secret: bytes | None) -> signed_store.SignedStore:
    """Keys of this launch only (a torchrun restart or a requeue starts on a clean namespace),
    hpcdist's values signed with `secret`: anyone who reaches the port can name the keys, and
    list them, but not write a value hpcdist takes for its own."""
    import torch.distributed as dist

    prefix = f"hpcdist/{key}"
    return signed_store.SignedStore(dist.PrefixStore(prefix, store), secret, prefix)


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise BootstrapError(
            f"rendezvous: first host {host!r} does not resolve ({cause_text(exc)}) and no other way to "
            f"find rank 0 was available; set storage.scratch on shared storage or launch with MPI"
        ) from exc


def _wait_for_file(path: Path, timeout: float, info: RankInfo) -> dict[str, Any]:
    found = poll_until(lambda: _read_endpoint(path), timeout, _POLL_S)
    if found is None:
        raise BootstrapError(
            f"rendezvous: rank 0 did not publish its address in {path} within {timeout:g} s "
            f"(waiting rank {info.rank} on {info.hostname}); rank 0 died or never started"
        )
    return found


def _private(folder: Path) -> None:
    """The rendezvous folder: this user's own, 0700 (``hpcdist.files.trust.private_folder``)."""
    from hpcdist.files.trust import UntrustedFileError, private_folder

    try:
        private_folder(folder)
    except UntrustedFileError as exc:
        raise BootstrapError(f"rendezvous: {exc}") from exc


def _read_endpoint(path: Path) -> dict[str, Any] | None:
    """The published endpoint; None while rank 0 has not written it (atomically) yet; or
    ``{"refused": why}`` at once for a file that is not this user's own regular 0600 file in
    folders no one else may write (a planted endpoint would make its writer rank 0 of the job):
    read from the descriptor that was checked (``hpcdist.files.trust.read_trusted``)."""
    from hpcdist.files.trust import UntrustedFileError, read_trusted

    try:
        data = json.loads(read_trusted(path, path.parent.parent, private=True, limit=65536))
    except FileNotFoundError:
        return None
    except UntrustedFileError as exc:
        return {"refused": f"{exc}; nothing was read from it"}
    except (OSError, ValueError):
        return None
    return dict(data) if isinstance(data, dict) else {"refused": f"{path} holds no endpoint"}


def rendezvous(info: RankInfo, timeout: float, env: Mapping[str, str], rendezvous_dir: Path | None,
               ifname: str | None, mpi_comm: Any = None, gpus: Sequence[str] = (),
               prefer: int = 0) -> tuple[signed_store.SignedStore, Endpoint, dict[int, str], int | None]:
    """The whole rendezvous, the one sequence every bootstrap runs (a job's, and ``hpcdist.init()``
    outside one): rank 0's store opened and published, every rank checked in (with the GPUs it
    sees under NCCL: see ``take_seats``), the endpoint file removed; the store, its endpoint, every
    rank's host and this rank's GPU (an index into `gpus`; None without)."""
    key = rendezvous_key(dict(env), info)
    store, endpoint = open_store(info, timeout, rendezvous_dir=rendezvous_dir, key=key, mpi_comm=mpi_comm,
                                 ifname=ifname, key_file=signed_store.key_file(env, info.job_id))
    signed_store.use(store)  # the roll call after a failure answers through it
    hosts_by_rank, gpu = take_seats(store, info, timeout, gpus, prefer)
    forget_endpoint(rendezvous_dir, key, info)
    return store, endpoint, dict(hosts_by_rank), gpu  # the rank's own copy (ctx.hosts): its process, its memory


def init_process_group(
    store: Store, info: RankInfo, backend: str, timeout: float, device: torch.device | None = None
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
        store=dist.PrefixStore("pg", signed_store.plain(store)),  # torch's keys: its own, unsigned
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=abort.group_timeout(timeout, backend, os.environ)),  # a test's imitated NCCL
        **kwargs,
    )
