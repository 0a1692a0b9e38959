"""hpcdist's own rank-side costs at 256 to 16,384 ranks, beside torch's bare rendezvous, simulated.

Each rank is a thread with its own TCP connection to one real TCPStore server (libuv, torch's
default), in its own process so its peak memory is its own; the ranks are spread over several
processes (``--procs``; one per 256 ranks), ``--per-node`` ranks per simulated node named as a
cluster's are (``gpu-node-000123``, 15 characters). No process group is made. Two paths, in the
same run:

- ``torch``: what ``init_process_group`` does over env://: each rank's TCPStore client (with the
  world size, as torch's rendezvous makes it), then torch's own ``_store_based_barrier``; then,
  as the peer of the roll call's last step, the bare store in the same shape (``wake-all``): every
  rank but rank 0 starts a thread that waits for one key and reads it, and waits for that thread
  within a bound; rank 0 sets the key after ``--roll-call-s``;
- ``hpcdist``: hpcdist's own code, phase by phase: ``group.open_store`` (a client, the job's key,
  the signed store), ``take_seats`` with eight GPU UUIDs per rank (the check-in, host table and
  GPU seats), ``--beats`` beats per rank, the roll call after one failure (one rank silent, every
  other calls ``rollcall.roll_call`` and must name the silent rank's node), then every rank's
  ``finish`` (check-out, and rank 0's end watch over every rank, the silent one checking out as
  failed).

Printed per N and phase: the wall time (from releasing every rank to the last one done, and to
half of them), store requests and bytes per rank (mean, and the most any rank other than rank 0
made; rank 0 apart), the clients' memory per rank and the server's peak above its own start, and
the CPU seconds the ranks' processes (user and system) and the server spent in it.
Requests and bytes are counted at each client, as TCPStore's wire format carries them (a 1-byte
command, 8-byte lengths before each key and value, the PrefixStore's prefix in each key),
excluding the TCPStore client's own connect and handshake, which both paths pay alike. The
ranks share this machine's cores: times are an upper bound, counts do not depend on the machine.

A rank of a job owns its interpreter; here 256 share one, and one lock (the GIL). Python hands
that lock on every 5 ms by default, and every thread waiting for it wakes at that interval to
ask for it; when one key wakes hundreds of threads of each process at once (each rank's thread
that waits for the roll call's verdict, then the rank's own thread that waits for it within its
bound), those wake-ups can take both cores as system time for tens of seconds, torch's bare store
in the same shape (``wake-all``) alike. The rank processes hand the lock on every
``--switch-interval`` (0.1 s) instead; 0.005 is Python's (docs/performance.md has both).
Run:

    python benchmarks/scale_sim.py --ranks 256 1024 4096 16384 [--skip "roll call"] [--json FILE]

It exits 1 where a rank's roll call did not name the silent rank alone (each such answer is
counted and one shown), and stops naming the phase where a rank raised or a process ended.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# torch's TCPStore client looks up its own socket's address by name (for its log lines); where the
# resolver cannot answer (a sandbox without DNS), each lookup waits the resolver's timeout (5 s,
# twice): bounded here at 1 s, for both paths alike. torch's warnings about it are not printed.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hpcdist.runtime import group, rollcall, signed_store  # noqa: E402
from hpcdist.runtime.rankinfo import RankInfo  # noqa: E402

PHASES = {"torch": ("connect", "barrier", "wake-all"),
          "hpcdist": ("connect", "check-in", "beats", "roll call", "check-out")}
GPUS_PER_NODE = 8


def host(rank: int, per_node: int) -> str:
    return f"gpu-node-{rank // per_node:06d}"


def gpu_uuids(node: int) -> list[str]:
    """Eight UUIDs as nvidia-smi writes them (40 characters)."""
    return [f"GPU-{node:08x}-{g:04x}-4000-8000-{node * GPUS_PER_NODE + g:012x}" for g in range(GPUS_PER_NODE)]


class Tally:
    """Requests and bytes one rank sent and received through the store, per phase."""

    def __init__(self) -> None:
        self.phase = ""
        self.counts: dict[str, list[int]] = {}

    def add(self, sent: int, received: int) -> None:
        row = self.counts.setdefault(self.phase, [0, 0])
        row[0] += 1
        row[1] += sent + received


def _s(x: str | bytes) -> int:
    return 8 + len(x.encode() if isinstance(x, str) else x)


class Counted:
    """A store client that counts what passes through it (`prefix`: what the PrefixStore below
    adds to each key on the wire)."""

    def __init__(self, store: Any, prefix: str, tally: Tally) -> None:
        self._store, self._extra, self._tally = store, len(prefix) + 1 if prefix else 0, tally

    def _k(self, keys: Sequence[str]) -> int:
        return 8 + sum(_s(k) + self._extra for k in keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def set(self, key: str, value: str | bytes) -> None:
        self._tally.add(1 + _s(key) + self._extra + _s(value), 0)
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        got = bytes(self._store.get(key))
        self._tally.add(1 + _s(key) + self._extra, _s(got))
        return got

    def add(self, key: str, amount: int) -> int:
        self._tally.add(1 + _s(key) + self._extra + 8, 8)
        return int(self._store.add(key, amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        got = bytes(self._store.compare_set(key, expected, desired))
        self._tally.add(1 + _s(key) + self._extra + _s(expected) + _s(desired), _s(got))
        return got

    def check(self, keys: list[str]) -> bool:
        self._tally.add(1 + self._k(keys), 1)
        return bool(self._store.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._tally.add(1 + self._k(keys), 1)
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        got = [bytes(v) for v in self._store.multi_get(keys)]
        self._tally.add(1 + self._k(keys), sum(_s(v) for v in got))
        return got

    def delete_key(self, key: str) -> bool:
        self._tally.add(1 + _s(key) + self._extra, 8)
        return bool(self._store.delete_key(key))


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _server(conn: Any, timeout: float) -> None:
    """The store's server, alone in this process: its port and memory at start, then its peak."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False,
                           use_libuv=True)
    conn.send((server.port, _rss_kib(os.getpid(), "VmRSS")))
    conn.recv()  # the run is over
    conn.send(_rss_kib(os.getpid(), "VmHWM"))
    conn.recv()


class Rank:
    """One simulated rank: its facts, its store, what it counted."""

    def __init__(self, rank: int, world: int, per_node: int, port: int) -> None:
        self.info = RankInfo(launcher="torchrun", rank=rank, world_size=world, local_rank=rank % per_node,
                             local_world_size=per_node, node_rank=rank // per_node,
                             num_nodes=-(-world // per_node), hostname=host(rank, per_node), job_id="sim",
                             master_addr="127.0.0.1", master_port=port)
        self.tally = Tally()
        self.ends: dict[str, float] = {}  # phase -> when this rank was done with it (the system's monotonic clock)
        self.store: Any = None
        self.hosts: Any = None
        self.error = ""
        self.wrong = ""  # what this rank's roll call said, where it did not name the silent rank alone


def _torch_phase(me: Rank, phase: str, args: argparse.Namespace, key: str) -> None:
    info = me.info
    if phase == "connect":
        client = dist.TCPStore("127.0.0.1", info.master_port or 0, info.world_size, False,
                               timedelta(seconds=args.timeout))
        me.store = Counted(dist.PrefixStore("default_pg", client), "default_pg", me.tally)
    elif phase == "wake-all":
        _wake_all(me, args)
    else:
        from torch.distributed.distributed_c10d import _store_based_barrier

        _store_based_barrier(info.rank, me.store, "sim", info.world_size,  # type: ignore[arg-type]
                             timedelta(seconds=args.timeout))


def _wake_all(me: Rank, args: argparse.Namespace) -> None:
    """The roll call's wait for its verdict on torch's bare store: no MAC, no count, no verdict."""
    key = "sim/wake-all"
    if me.info.rank == 0:
        time.sleep(args.roll_call_s)
        me.store.set(key, f"[{me.info.world_size // 2 + 1}]")
        return
    got: list[bytes] = []
    done = threading.Event()

    def read() -> None:
        me.store.wait([key], timedelta(seconds=args.roll_call_s + args.verdict_s))
        got.extend(me.store.multi_get([key]))
        done.set()

    try:
        threading.Thread(target=read, daemon=True).start()
    except RuntimeError:  # no thread to spare, as rollcall.roll_call: read in this one
        read()
    if not done.wait(args.roll_call_s + args.verdict_s + 2.0):
        raise TimeoutError(f"{key} not read within {args.roll_call_s + args.verdict_s + 2.0:g} s")


class Silent(Exception):
    """What the silent rank's collective raised (it does not answer the roll call)."""


def _hpcdist_phase(me: Rank, phase: str, args: argparse.Namespace, key: str) -> None:
    info = me.info
    silent = info.world_size // 2 + 1
    if phase == "connect":
        store, _ = group.open_store(info, args.timeout, rendezvous_dir=None, key=key,
                                    key_file=Path(args.key_file))
        store.plain = Counted(store.plain, store.prefix, me.tally)
        me.store = store
    elif phase == "check-in":
        node = info.rank // info.local_world_size
        table, gpu = group.take_seats(me.store, info, args.timeout, gpu_uuids(node), info.local_rank)
        want_runs = [["gpu-node-", "000000", "", info.world_size // info.local_world_size, info.local_world_size]]
        if [list(r) for r in table.runs] != want_runs or gpu != info.local_rank or table[info.rank] != info.hostname:
            raise AssertionError(f"rank {info.rank}: table {table.runs!r}, GPU {gpu}")
        me.hosts = table
    elif phase == "beats":
        for _ in range(args.beats):
            group.beat(me.store, info)
    elif phase == "roll call":
        if info.rank == silent:
            return
        said = rollcall.roll_call(info.rank, _Hosts(me.hosts), wait_s=args.roll_call_s, store=me.store,
                                  verdict_s=args.verdict_s)
        silent_node = host(silent, info.local_world_size)
        if not said.startswith(f"no answer within {args.roll_call_s:g} s from {silent_node} (rank {silent}): "):
            me.wrong = said[:300]  # counted and shown (a rank named with it too: one late to answer); the run goes on
    elif phase == "check-out":
        if info.rank == silent:
            group.check_out(me.store, info, failed=True)
        late = group.finish(me.store, info, args.timeout)
        if late:
            raise AssertionError(f"rank 0 gave up on ranks {late}")


class _Hosts(Sequence[str]):
    """The host table as the roll call takes it (a rank's ``ctx.hosts``), without expanding it."""

    def __init__(self, table: Any) -> None:
        self._table = table

    def __getitem__(self, i: Any) -> Any:
        return self._table[i]

    def __len__(self) -> int:
        return len(self._table)


def _ranks_process(ranks: range, world: int, args: argparse.Namespace, port: int, path: str, key: str,
                   barrier: Any, conn: Any) -> None:
    """Threads for `ranks`, run phase by phase; each phase starts when every process is ready."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    threading.stack_size(512 * 1024)
    sys.setswitchinterval(args.switch_interval)
    run: Callable[[Rank, str, argparse.Namespace, str], None] = (_torch_phase if path == "torch"
                                                                   else _hpcdist_phase)
    mine = [Rank(r, world, args.per_node, port) for r in ranks]
    go = threading.Barrier(len(mine) + 1)
    end = threading.Barrier(len(mine) + 1)

    def rank(me: Rank) -> None:
        for phase in PHASES[path]:
            go.wait()
            me.tally.phase = phase
            if not me.error:
                try:
                    run(me, phase, args, key)
                except Exception as exc:  # noqa: BLE001 - reported to the parent
                    me.error = f"rank {me.info.rank} in {phase}: {type(exc).__name__}: {exc}"[:500]
            me.ends[phase] = time.monotonic()
            end.wait()

    threads = [threading.Thread(target=rank, args=(me,), daemon=True) for me in mine]
    for t in threads:
        t.start()
    barrier.wait()  # every process ready: the parent's clock starts
    rss: dict[str, int] = {"start": _rss_kib(os.getpid(), "VmRSS")}
    cpu: dict[str, tuple[float, float]] = {}
    for phase in PHASES[path]:
        before = os.times()
        go.wait()
        end.wait()
        rss[phase] = _rss_kib(os.getpid(), "VmRSS")
        after = os.times()
        cpu[phase] = (after.user - before.user, after.system - before.system)
        barrier.wait()  # every rank of every process done with the phase
    errors = [me.error for me in mine if me.error][:3]
    wrong = [me.wrong for me in mine if me.wrong]
    conn.send(({me.info.rank: me.tally.counts for me in mine}, {me.info.rank: me.ends for me in mine}, rss, cpu,
               errors, (len(wrong), wrong[:1])))
    for t in threads:
        t.join(5)
    conn.recv()  # stores stay open until the parent has stopped the clock of every path
    os._exit(0)


def _cpu_s(pid: int | None) -> float:
    """The CPU seconds (user and system) process `pid` has spent so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _watch(procs: list[Any], barrier: Any) -> None:
    """Break the run's barrier when a process ends before the run does (killed for memory, say)."""
    while not barrier.broken:
        if any(p.exitcode is not None for p in procs):
            barrier.abort()
            return
        time.sleep(0.5)


def one_path(path: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of `path` at `world` ranks: each phase's seconds, counts per rank, the server's peak."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_server, args=(child, args.timeout), daemon=True)
    server.start()
    port, base_kib = parent.recv()
    procs_n = max(1, min(args.procs or world // 256, world))
    barrier = ctx.Barrier(procs_n + 1)
    pipes, procs = [], []
    key = f"sim.{path}.{world}.{os.getpid()}"
    for p in range(procs_n):
        a, b = ctx.Pipe()
        ranks = range(p * world // procs_n, (p + 1) * world // procs_n)
        proc = ctx.Process(target=_ranks_process, args=(ranks, world, args, port, path, key, barrier, b), daemon=True)
        proc.start()
        pipes.append(a)
        procs.append(proc)
    seconds: dict[str, float] = {}
    starts: dict[str, float] = {}
    server_cpu: dict[str, float] = {}
    watch = threading.Thread(target=_watch, args=(procs + [server], barrier), daemon=True)
    watch.start()
    try:
        barrier.wait(timeout=args.timeout)  # every process has its threads
        for phase in PHASES[path]:
            starts[phase], server_before = time.monotonic(), _cpu_s(server.pid)
            barrier.wait(timeout=args.timeout * 3)  # every rank done with the phase
            seconds[phase] = time.monotonic() - starts[phase]
            server_cpu[phase] = _cpu_s(server.pid) - server_before
    except threading.BrokenBarrierError:
        dead = [f"pid {p.pid}: exit code {p.exitcode}" for p in procs + [server] if p.exitcode is not None]
        for proc in procs + [server]:
            proc.kill()
        raise SystemExit(f"{path} at {world} ranks: {', '.join(dead) or 'timed out'} "
                         f"(after phase(s) {', '.join(seconds) or 'none'})") from None
    counts: dict[int, dict[str, list[int]]] = {}
    ends: dict[int, dict[str, float]] = {}
    rss_kib: dict[str, int] = {}
    cpu_s = {phase: [0.0, 0.0] for phase in PHASES[path]}
    errors: list[str] = []
    wrong: list[Any] = [0, []]
    for a in pipes:
        got, got_ends, rss, cpu, errs, (n_wrong, said) = a.recv()
        wrong[0] += n_wrong
        wrong[1] += said
        counts.update(got)
        ends.update(got_ends)
        errors += errs
        for phase, kib in rss.items():
            rss_kib[phase] = rss_kib.get(phase, 0) + kib
        for phase, (user, system) in cpu.items():
            cpu_s[phase][0] += user
            cpu_s[phase][1] += system
    client_kib = {phase: (rss_kib[phase] - rss_kib["start"]) / world for phase in PHASES[path]}
    half = {phase: statistics.median(e[phase] - starts[phase] for e in ends.values() if phase in e)
            for phase in PHASES[path]}
    parent.send("done")
    peak_kib = parent.recv()
    for a in pipes:
        a.send("bye")
    for proc in procs:
        proc.join(30)
    parent.send("bye")
    server.join(10)
    if errors:
        raise SystemExit(f"{path} at {world} ranks: " + "; ".join(errors))
    return {"seconds": seconds, "half_done": half, "counts": counts, "server_peak_mib": (peak_kib - base_kib) / 1024,
            "client_kib_per_rank": client_kib, "ranks_cpu_s": cpu_s, "server_cpu_s": server_cpu,
            "switch_interval_s": args.switch_interval, "roll_call_wrong": wrong[0], "roll_call_said": wrong[1][:1]}


def per_rank(counts: dict[int, dict[str, list[int]]], phases: Sequence[str]) -> dict[str, float]:
    """Mean and most requests and bytes of ranks other than rank 0 over `phases`, and rank 0's."""
    def total(r: int, i: int) -> int:
        return sum(counts[r].get(p, [0, 0])[i] for p in phases)

    others = [r for r in counts if r != 0]
    return {"requests": statistics.mean(total(r, 0) for r in others), "requests_max": max(total(r, 0) for r in others),
            "bytes": statistics.mean(total(r, 1) for r in others), "bytes_max": max(total(r, 1) for r in others),
            "rank0_requests": total(0, 0), "rank0_bytes": total(0, 1)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    p.add_argument("--procs", type=int, default=0,
                   help="processes the ranks are spread over (default: one per 256 ranks: a thousand threads "
                        "contending for one interpreter's lock take the cores from the store's server)")
    p.add_argument("--per-node", type=int, default=GPUS_PER_NODE, help="ranks per simulated node")
    p.add_argument("--beats", type=int, default=3)
    p.add_argument("--roll-call-s", type=float, default=rollcall.ROLL_CALL_S)
    p.add_argument("--verdict-s", type=float, default=120.0,
                   help="how long past --roll-call-s a rank waits for the roll call's verdict (a job's rank: "
                        "rollcall.verdict_wait_s): this machine's two cores wake thousands of ranks' threads, "
                        "where a cluster's nodes wake their own")
    p.add_argument("--switch-interval", type=float, default=0.1,
                   help="how often a rank process's interpreter hands its lock on (sys.setswitchinterval): "
                        "Python's 0.005 wakes every thread waiting for it that often, which costs this machine's "
                        "kernel in proportion to the 256 ranks sharing it, where a job's rank has its own")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--skip", nargs="*", default=[], choices=("beats", "roll call", "wake-all"),
                   help="phases to leave out")
    p.add_argument("--hpcdist-first", action="store_true",
                   help="run hpcdist's path before torch's (the second path's connects find the first's ports in "
                        "TIME_WAIT)")
    p.add_argument("--json", type=Path, help="also write every figure here")
    return p


def main() -> int:
    args = parser().parse_args()
    for path in PHASES:
        PHASES[path] = tuple(p for p in PHASES[path] if p not in args.skip)
    with tempfile.TemporaryDirectory() as tmp:
        args.key_file = str(signed_store.make_key(Path(tmp), "sim"))
        print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.procs or 'one per 256 ranks in'} processes "
              f"(switch interval {args.switch_interval:g} s), {args.per_node} ranks per node; requests and bytes per "
              f"rank: mean (most), rank 0 apart", flush=True)
        out = []
        for world in args.ranks:
            row: dict[str, Any] = {"ranks": world}
            for path in ("hpcdist", "torch") if args.hpcdist_first else ("torch", "hpcdist"):
                row[path] = one_path(path, world, args)
            out.append(row)
            _print(row)
            if args.json:
                args.json.write_text(json.dumps([_summary(r) for r in out], indent=1))
    return 1 if any(r["hpcdist"]["roll_call_wrong"] for r in out) else 0


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    """`row` without each rank's counts: per phase, what ``per_rank`` makes of them."""
    out: dict[str, Any] = {"ranks": row["ranks"]}
    for path in PHASES:
        res = row[path]
        out[path] = {**{k: v for k, v in res.items() if k != "counts"},
                     "per_rank": {phase: per_rank(res["counts"], [phase]) for phase in PHASES[path]}}
    return out


def _print(row: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    world = row["ranks"]
    torch_s = row["torch"]["seconds"]["connect"] + row["torch"]["seconds"]["barrier"]
    rdv = row["hpcdist"]["seconds"]["connect"] + row["hpcdist"]["seconds"]["check-in"]
    table = Table(title=f"{world:,} ranks: rendezvous hpcdist {rdv:.2f} s, torch {torch_s:.2f} s "
                        f"({rdv / torch_s:.2f}x)", title_justify="left")
    for name in ("path", "phase", "s", "half done, s", "requests/rank", "bytes/rank", "rank 0 requests",
                 "rank 0 bytes", "client KiB/rank", "ranks' CPU s user/sys", "server CPU s", "server peak MiB"):
        table.add_column(name, justify="left" if name in ("path", "phase") else "right")
    for path in ("torch", "hpcdist"):
        res = row[path]
        for phase in PHASES[path]:
            c = per_rank(res["counts"], [phase])
            table.add_row(path, phase, f"{res['seconds'][phase]:.2f}", f"{res['half_done'][phase]:.2f}",
                          f"{c['requests']:.1f} ({c['requests_max']})", f"{c['bytes']:.0f} ({c['bytes_max']})",
                          str(c["rank0_requests"]), str(c["rank0_bytes"]), f"{res['client_kib_per_rank'][phase]:.0f}",
                          "{:.1f}/{:.1f}".format(*res["ranks_cpu_s"][phase]), f"{res['server_cpu_s'][phase]:.1f}",
                          f"{res['server_peak_mib']:.1f}" if phase == PHASES[path][-1] else "")
    Console(width=200).print(table)
    if row["hpcdist"]["roll_call_wrong"]:
        print(f"roll call: {row['hpcdist']['roll_call_wrong']} of {world - 1} ranks did not name the silent rank "
              f"alone, e.g. {row['hpcdist']['roll_call_said']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
