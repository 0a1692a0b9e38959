"""What every benchmark kind shares on the ranks: its paths, node names, the result record,
the interconnect facts, the figures each row is a fraction of, and the verdict.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hpcdist import track
from hpcdist.bench.base import CommPath
from hpcdist.bench.measure import Local, Watchdog, maybe_fault
from hpcdist.bench.record import BenchRecord, rank_layout
from hpcdist.errors import BenchmarkError, HpcdistError
from hpcdist.runtime import abort
from hpcdist.runtime.plain import all_gather_plain, broadcast_plain
from hpcdist.runtime.rollcall import roll_call, timed_out

if TYPE_CHECKING:
    from hpcdist.runtime.job_rank import JobRank


def node_name(ctx: JobRank, env: dict[str, str] | None = None) -> str:
    """This rank's node as the scheduler names it (hostnames can repeat on emulated clusters)."""
    env = dict(os.environ) if env is None else env
    if env.get("SLURMD_NODENAME"):
        return env["SLURMD_NODENAME"]
    hosts = ctx.info.hosts
    if hosts and 0 <= ctx.info.node_rank < len(hosts):
        return hosts[ctx.info.node_rank]
    return ctx.info.hostname


def make_paths(ctx: JobRank, names: Sequence[str], mpi_buffers: str) -> list[CommPath]:
    """The communication paths the job asked for, in its order."""
    out: list[CommPath] = []
    for name in names:
        if name == "torch":
            from hpcdist.bench.torch_path import TorchPath

            out.append(TorchPath(ctx.device, ctx.backend))
        else:
            from hpcdist.bench.mpi_path import MPIPath

            out.append(MPIPath(ctx.mpi_comm, mpi_buffers, ctx.device, ctx.site.network.mpi_cuda_aware))
    return out


class Session:
    """One benchmark run on this rank; rank 0 also owns the result record."""

    def __init__(self, ctx: JobRank, params: Any) -> None:
        from hpcdist.runtime.doctor import ib_ports

        self.ctx = ctx
        self.params = params
        self.rank = ctx.rank
        self.paths = make_paths(ctx, params.paths, getattr(params, "mpi_buffers", "numpy"))
        mine = (ctx.info.node_rank, node_name(ctx), [vars(p) | {"rate_gbps": p.rate_gbps} for p in ib_ports()])
        facts = all_gather_plain(mine, what="its node and InfiniBand ports")
        self.node_of_rank = [f[1] for f in facts]
        self.nodes, layout = rank_layout(tuple(self.node_of_rank), ctx.hosts)
        self.watchdog = Watchdog(ctx.timeout_s, ctx.log, ctx.rank)
        self.record: BenchRecord | None = None
        self.interconnect: list[dict[str, Any]] = []
        seen: set[str] = set()
        for _, host, ports in facts:
            if host not in seen:
                seen.add(host)
                self.interconnect += [{"host": host, **p} for p in ports]
        if ctx.is_main:
            attrs = ctx.run_attrs()
            attrs.update(
                nodes=self.nodes,
                rank_nodes=list(self.node_of_rank),
                num_nodes=len(self.nodes),
                rank_layout=layout,
                params_json=params.model_dump_json(),
                baselines_json=ctx.site.baselines.model_dump_json(),
                paths=[p.label for p in self.paths],
            )
            network = ctx.site.network.model_dump(mode="json")
            network = {k: (json.dumps(v) if isinstance(v, (list, tuple)) else v) for k, v in network.items()}
            self.record = BenchRecord(ctx.result_path(), attrs, self.interconnect, network)
            self.record.flush(complete=False)
            self.record.tracking = track.open_run(ctx.spec, ctx.site, ctx.job_id, ctx.rank)  # each row's bandwidth
            self.watchdog.note = f"; the rows measured before it are in {self.record.path} (complete=False)"

    # ---- figures each row is compared with
    def link_rate(self) -> tuple[float | None, str]:
        """The per-port link rate in GB/s: the site's figure, else the slowest active IB port seen."""
        net = self.ctx.site.network
        if net.link_rate_gbps:
            return net.link_rate_gbps / 8.0, f"link rate {net.link_rate_gbps:g} Gb/s (site network)"
        active = [p for p in self.interconnect if p["state"] == "ACTIVE" and p["rate_gbps"]]
        if active:
            slow = min(active, key=lambda p: p["rate_gbps"])
            return slow["rate_gbps"] / 8.0, f"link rate {slow['rate_gbps']:g} Gb/s ({slow['device']} on {slow['host']})"
        return None, "nothing: set baselines.expected_* or network.link_rate_gbps in the site config"

    def expected(self, op: str) -> tuple[float | None, str]:
        """The figure a row of `op` states its fraction of (GB/s), and what it is."""
        base = self.ctx.site.baselines
        if op.startswith("p2p") or op == "pairs":
            if base.expected_p2p_gbps:
                return base.expected_p2p_gbps, f"expected p2p {base.expected_p2p_gbps:g} GB/s (site baselines)"
        elif op in base.expected_busbw_gbps:
            v = base.expected_busbw_gbps[op]
            return v, f"expected {op} busbw {v:g} GB/s (site baselines)"
        return self.link_rate()

    # ---- running measurements
    def run_one(self, path: CommPath, what: str, op: str, size: int, fn: Callable[[], Any]) -> list[Any] | None:
        """Run one measurement under the watchdog and gather its figures to rank 0.

        Any failure becomes a BenchmarkError naming the operation, size and path; rank 0 first
        writes what was measured so far, marked incomplete; also when NCCL's watchdog is about to
        end the rank instead (``hpcdist.runtime.abort``).
        """
        try:
            with self.watchdog.guard(what), abort.phase(what, "BenchmarkError", self._keep_rows(what)):
                maybe_fault(self.rank, op, size, self.ctx.log)
                local = fn()
                got = path.gather(local.as_plain() if isinstance(local, Local) else local)
                return None if got is None else [Local.from_plain(v) for v in got]
        except HpcdistError:
            raise
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            site = self.ctx.site if timed_out(exc) else None  # a time-out: a dead node or link, marked
            gone = roll_call(self.rank, self.node_of_rank, site=site, job_id=self.ctx.job_id, what=what)
            where = f"; {gone}" if gone else ""
            if self.record is not None:
                self.record.flush(complete=False, verdict=f"failed at {what}: {first}{where}")
                where += f"; the rows measured before it are in {self.record.path} (complete=False)"
            raise BenchmarkError(
                f"{what} failed on rank {self.rank} ({self.node_of_rank[self.rank]}): "
                f"{type(exc).__name__}: {first}{where}"
            ) from exc

    def _keep_rows(self, what: str) -> Callable[[str], str]:
        """What rank 0 does before the backend ends it: the rows so far written, marked incomplete."""

        def keep(failure: str) -> str:
            if self.record is None:
                return ""
            self.record.flush(complete=False, verdict=f"failed at {what}: {failure}")
            return f"; the rows measured before it are in {self.record.path} (complete=False)"

        return keep

    def finish(self, shortfalls: list[str], enforce: bool) -> dict[str, Any]:
        """Mark the file complete with its verdict; every rank fails if a minimum was missed."""
        verdict = "ok" if not shortfalls else "below minimum: " + "; ".join(shortfalls)
        out: dict[str, Any] = {}
        if self.record is not None:
            self.record.flush(complete=True, verdict=verdict)
            if self.record.tracking is not None:
                self.record.tracking.artifact(self.record.path)
                self.record.tracking.close(finished=True)
            out["result"] = str(self.record.path)
            out["verdict"] = verdict
        shortfalls = broadcast_plain(shortfalls, src=0, what="the shortfalls")
        if shortfalls and enforce:
            where = f" (result: {self.record.path})" if self.record is not None else ""
            raise BenchmarkError(
                "below the site's minimum: " + "; ".join(shortfalls) + where
                + "; check those nodes or links, or lower the site's baselines if the hardware changed"
            )
        return out
