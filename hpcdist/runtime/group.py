"""From rank facts to a torch.distributed process group, with no hang and no name lookup.

Rank 0 opens a TCPStore on a free port (so two jobs sharing a node never collide), listening on
the published address only, and publishes ``address:port``: over MPI when mpi4py is up (or its
error, so no rank waits for an endpoint that will never come), else in a file on shared storage,
else (no shared directory) on the first host of the node list with a port derived from the job id.
hpcdist's own messages in the store are signed (``hpcdist.runtime.signed_store``): with the job's
key file, or a key rank 0 sends with its endpoint.
Every rank then checks in: a counter and one blocking wait per rank, so store requests grow
linearly with the ranks; a rank that does not arrive within the timeout is named in the error
that every other rank raises. Every wait here has the job's finite timeout.

Over 400 lines: the store's opening, its secret, the three ways of publishing the endpoint and
the check-in are one protocol, whose timeouts and error messages must agree; split across
modules, each half would need the other's details.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
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


def check_in(store: Store, info: RankInfo, timeout: float) -> dict[int, str]:
    """Every rank announces itself and waits for all others; returns rank -> host (`take_seats`
    without GPUs)."""
    return take_seats(store, info, timeout)[0]


def take_seats(store: Store, info: RankInfo, timeout: float, gpus: Sequence[str] = (),
               prefer: int = 0) -> tuple[dict[int, str], int | None]:
    """Every rank announces itself and waits for all others; returns rank -> host, and under NCCL
    this rank's GPU: an index into `gpus`, the UUIDs of the GPUs it sees, in CUDA's order.

    Rank 0, seeing every rank's GPUs, gives each a GPU of its own (``place_gpus``): where each task
    sees a subset (``--gpu-bind=closest``), the local rank modulo what a task sees would give two
    ranks one GPU. Ranks that can only have a GPU another rank has are refused here, on every rank
    with the same message, before NCCL's "Duplicate GPU detected" would stop ``init_process_group``
    naming neither the ranks nor what to change. `prefer` is the index this rank would take alone.

    Requests grow linearly with the ranks: each rank sets its key and bumps a counter; the last
    to arrive marks the roll complete; rank 0 then reads every key in one request and publishes
    the host table, which every other rank waits for (one blocking wait, no polling).
    A rank missing after `timeout` is named in the error every waiting rank raises. The count
    only says when to look: rank 0 reads the signed seats themselves (``signed_store``), so a
    forged count or seat delays the roll, never changes it.
    """
    seat = f"{info.hostname} {prefer} {','.join(gpus)}" if gpus else info.hostname
    store.set(f"hpcdist/join/{info.rank}", seat)
    _count_in(store, "hpcdist/joined", info.world_size)
    keys = _rank_keys("hpcdist/join", info.world_size)
    shared = ""
    placed: list[int] = []
    try:
        if info.is_main:
            store.wait(["hpcdist/joined/all"], timedelta(seconds=timeout))
            seats = [v.decode().split(" ", 2) for v in store.multi_get(keys)]
            hosts: Any = [s[0] for s in seats]
            placed, shared = place_gpus(seats)
            if gpus and not shared:
                store.set("hpcdist/gpus", json.dumps(placed))
            store.set("hpcdist/hosts", json.dumps({"shared": shared} if shared else hosts))
        else:
            store.wait(["hpcdist/hosts"], timedelta(seconds=timeout))
            hosts = json.loads(store.get("hpcdist/hosts"))
            if isinstance(hosts, dict) and "missing" in hosts:  # rank 0 gave up: it names them to everyone
                raise TimeoutError(f"rank 0 saw rank(s) {_ranks(hosts['missing'])} missing")
            if gpus and not isinstance(hosts, dict):
                placed = json.loads(store.get("hpcdist/gpus"))
    except Exception as exc:  # the wait timed out, or rank 0 (the store's server) gave up or died
        missing = _missing(store, keys)
        if info.is_main and missing is not None:
            try:
                store.set("hpcdist/hosts", json.dumps({"missing": missing}))
            except Exception:  # noqa: BLE001 - best effort: the others time out on their own
                pass
        if missing is None:
            raise BootstrapError(
                f"rendezvous: rank(s) ? of {info.world_size} had not joined when rank 0's store closed "
                f"(this is rank {info.rank} on {info.hostname}; {cause_text(exc)}); see rank 0's log"
            ) from exc
        raise BootstrapError(
            f"rendezvous: rank(s) {_ranks(missing) or 'none'} of {info.world_size} did not join within "
            f"{timeout:g} s (this is rank {info.rank} on {info.hostname}); the missing rank "
            f"died or was never started: see its log"
        ) from exc
    if isinstance(hosts, dict) or (info.is_main and shared):
        _all_refused(store, info, timeout)
        raise BootstrapError(shared if info.is_main else hosts["shared"])
    return dict(enumerate(hosts)), (placed[info.rank] if gpus else None)


def _all_refused(store: Store, info: RankInfo, timeout: float) -> None:
    """Every rank has read rank 0's refusal before rank 0, the store's server, leaves with it: else a
    rank still waiting would see only the store close."""
    _count_in(store, "hpcdist/refused", info.world_size)
    if info.is_main:
        try:
            store.wait(["hpcdist/refused/all"], timedelta(seconds=min(timeout, 30.0)))
        except Exception:  # noqa: BLE001 - a rank that is gone cannot read it anyway
            pass


def place_gpus(seats: list[list[str]]) -> tuple[list[int], str]:
    """Each rank's GPU (an index into the GPUs it sees; -1 for a rank without) from every rank's seat
    (host, preferred index, comma-separated UUIDs): in rank order, each takes its preferred GPU, or
    the next one it sees that no rank on its host has taken. The refusal, when a rank finds none
    free, names it, the rank that holds its GPU and the host; else ""."""
    taken: dict[tuple[str, str], int] = {}
    out: list[int] = []
    for rank, seat in enumerate(seats):
        if len(seat) < 3 or not seat[2]:
            out.append(-1)
            continue
        host, prefer, uuids = seat[0], int(seat[1]), seat[2].split(",")
        order = [(prefer + i) % len(uuids) for i in range(len(uuids))]
        free = next((i for i in order if (host, uuids[i]) not in taken), None)
        if free is None:
            holder = taken[(host, uuids[prefer % len(uuids)])]
            return out, (f"ranks {holder}, {rank} were given one GPU ({uuids[prefer % len(uuids)]}) on {host}: NCCL "
                         f"needs a GPU per rank; bind one GPU per task (--gpus-per-task=1 or --gpu-bind) or set "
                         f"tasks_per_node to the GPUs per node")
        taken[(host, uuids[free])] = rank
        out.append(free)
    return out, ""


def _rank_keys(prefix: str, world_size: int) -> list[str]:
    return [f"{prefix}/{r}" for r in range(world_size)]


def _count_in(store: Store, counter: str, world_size: int) -> None:
    """Add this rank to `counter`; the rank that completes it sets ``<counter>/all`` for the waiters."""
    if store.add(counter, 1) == world_size:
        store.set(f"{counter}/all", "1")


def _missing(store: Store, keys: list[str]) -> list[int] | None:
    """The ranks whose key is absent (one request per rank: only after a failed wait); None when
    the store itself no longer answers."""
    try:
        return [r for r, k in enumerate(keys) if not store.check([k])]
    except Exception:  # noqa: BLE001 - the server is gone: any error means the same
        return None


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


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
    return store, endpoint, hosts_by_rank, gpu


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


def check_out(store: Store, info: RankInfo, failed: bool = False) -> None:
    """This rank is done (or failed: it will not finish), so rank 0 need not wait for it."""
    store.set(f"hpcdist/done/{info.rank}", "failed" if failed else "1")


def beat(store: Store, info: RankInfo) -> None:
    """This rank is alive and working: rank 0's end-of-job wait goes on while its beat changes (a
    signed value, not a counter: a forged beat is ignored)."""
    store.set(f"hpcdist/beat/{info.rank}", str(time.monotonic_ns()))


def finish(store: Store, info: RankInfo, timeout: float) -> list[int]:
    """A last check-out so rank 0 (the store's server) leaves only after every rank is done.

    Rank 0 waits in rounds of `timeout` for every rank's signed check-out. After a round, it
    watches the beat of each rank still missing (``watch_beat``): a rank that is still working
    (a genuine beat newer than the last one read, as the python job's watchdog writes every
    second) is waited for, however long it takes, up to the job's own time limit, since closing the
    store would stop it. Beats someone else writes back, forges or deletes neither keep rank 0
    waiting nor hide a genuine beat written during the watch (said in the log). A rank with no
    genuine new beat during the watch is given up on: rank 0 leaves anyway, the job's work being done
    and only the farewell late, but says so: a warning names the ranks that never checked out,
    which are returned.
    """
    check_out(store, info)
    if not info.is_main:
        return []
    done = _rank_keys("hpcdist/done", info.world_size)
    seen = {r: signed_store.signed(store).look(f"hpcdist/beat/{r}")[0] for r in range(info.world_size)}
    while True:
        try:
            store.wait(done, timedelta(seconds=timeout))
            return []
        except Exception as exc:  # noqa: BLE001 - timed out (the server is this process)
            missing = _missing(store, done) or []
            signs = {r: watch_beat(signed_store.signed(store), r, seen) for r in missing}
            tampered = [r for r in missing if signs[r] == "tampered"]
            if tampered:
                log.warning("check-out: the beat of rank(s) %s was written by someone else in the job's store (old "
                            "beats written back, forged or deleted): no sign of life, and none of death",
                            _ranks(tampered))
            alive = [r for r in missing if signs[r] == "working"]
            if alive:
                log.info("check-out: rank(s) %s still working after rank 0 finished; waiting for them",
                         _ranks(alive))
                continue
            still = _missing(store, done)  # a rank may have checked out while rank 0 watched its beat
            missing = missing if still is None else [r for r in missing if r in still]
            if not missing:
                return []
            log.warning(
                "check-out: rank(s) %s of %d did not check out within %g s (%s); rank 0 leaves anyway, "
                "their store connections close now: see their logs", _ranks(missing) or "?", info.world_size,
                timeout, cause_text(exc),
            )
            return missing


BEAT_WATCH_S = 3.0  # how long rank 0 watches a missing rank's beat key: three of the watchdog's beats


def watch_beat(store: signed_store.SignedStore, rank: int, seen: dict[int, bytes | None],
               watch_s: float = BEAT_WATCH_S) -> str:
    """Whether `rank` beat since rank 0 last read its beat (`seen`, updated): "working" (a genuine
    beat newer than the last one read), "tampered" (within `watch_s` the key was written, but only
    with values that are no newer genuine beat: replayed, forged, or deleted at once), or "silent"
    (nobody wrote it).

    Rank 0 takes each value it reads out of the store and waits for the key to be written again: a
    store wait wakes at every write, and rank 0 reads at once, so a rank that beats is seen even
    when someone writes old beats back or deletes them; and beats written back are no sign of life."""
    key = f"hpcdist/beat/{rank}"
    written = False
    deadline = time.monotonic() + watch_s
    while True:
        now, _ = store.look(key)
        if now is not None and now != seen.get(rank):
            seen[rank] = now
            return "working"
        left = deadline - time.monotonic()
        if left <= 0:
            break
        store.plain.delete_key(key)  # consumed: only a write after this wakes the wait below
        try:
            store.plain.wait([key], timedelta(seconds=left))
        except Exception:  # noqa: BLE001 - torch's wait timeout: no write since
            break
        written = True
    return "tampered" if written else "silent"
