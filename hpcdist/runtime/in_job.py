"""The in-job supervisor of a job with hot spares (``resources.spare_nodes``): a node that dies
costs seconds in the same allocation, not a requeue and a place at the back of the queue.

The batch script runs ``python -m hpcdist.runtime.in_job FOLDER -- srun ...`` (``login.plan``).
The job holds ``nodes + spare_nodes`` nodes under ``--no-kill``: Slurm takes a dead node out of the
allocation and leaves the job running. This process, on the batch node, runs the ranks as srun
steps on ``nodes`` of them; the spares run nothing. The batch node is the last node it gives
ranks to: its death takes this process with it (Slurm then leaves the ``--no-kill`` job running
without a batch script), so it is the spare kept longest. A rank finds it dead and cancels the
job, and the standby job queued behind it runs the job on: for a job with spares, hpcdist
resubmits a job for a node failure (``hpcdist.runtime.standby``).

- **Sign of life.** Each rank connects to the supervisor as it starts and says who it is; the
  connection, kept with TCP keepalives, shows a dead or cut-off node in about 3 s and a rank's
  process that ended at once (``hpcdist.runtime.in_job_link``, the line and the rank's end;
  ``hpcdist.runtime.in_job_port``, the supervisor's: every line signed with the job's key).
- **Evidence.** A connection that timed out proves nothing alone (a network blip, a forged
  line): a node is dead when Slurm says so or its slurmd gives no TCP reply within a second
  (``rollcall.evidence``, the roll call's own test). The nodes are also checked when a rank's
  job fails, and when a rank ended and srun did not say how within ``SETTLE_S`` (a node that
  died before its rank connected: the others fail at their rendezvous).
- **A rank's fault, every node alive.** srun runs with ``--kill-on-bad-exit=0 --wait=0``: each
  task's end is the supervisor's to judge (``in_job_steps.Step``). A rank whose process ended by a
  signal (the OOM killer, NCCL's watchdog, a segfault) or ended itself after a hung collective
  (``HUNG_EXIT``) starts again: by default the whole step on the same nodes (``on_rank_failure:
  step``); under ``in_place`` that rank alone, in a step of its own on its node taking its rank
  (``IN_PLACE_VAR``), while the others run the job again in their processes under the next restart
  number with the last checkpoint in memory (``hpcdist.api.kept``). A rank silent ``SILENT_S``
  after another died or failed is stuck or hung: it ends itself on the supervisor's word (one stuck
  in native code cannot: the step starts again whole), and only then are the others told to go
  on, so every rank meets at one new rendezvous. At most ``preemption.in_job_restarts_per_hour``
  such restarts in any hour; a node whose ranks die twice is taken out as a dead one
  (``in_job_faults``). An exception of the job's own code ends the job as without spares.
- **A dead node.** The steps are killed (``scancel --signal=KILL``); the dead node is marked in the
  site's node health record and in the job's node-failure record; a new step starts on the
  live nodes and a live spare with ``--overlap`` (the old step holds its CPUs until Slurm
  declares the dead node down, SlurmdTimeout later). The world size is the same, and the ranks
  resume from the last checkpoint as after a requeue: they get ``IN_JOB_RESTART_VAR``, and the
  checkpoint directory's claim passes to the later restart (``store.checkpoint.claim``).
- **No spare left.** The next step runs on the live nodes alone when the spec allows it
  (``resources.min_nodes``); else the job is requeued as without spares (``on_node_failure:
  requeue``, within ``preemption.max_requeues`` node failures: it runs again once as many nodes
  are free), or ends with one line naming the node and what to set.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hpcdist.config.contract import (
    IN_JOB_RESTART_VAR,
    IN_PLACE_VAR,
    KEEP_STATE_VAR,
    STOPPED,
    SUPERVISOR_VAR,
    restart_count,
)
from hpcdist.runtime.in_job_faults import Budget, Faults, dead, node_addresses
from hpcdist.runtime.in_job_port import Links
from hpcdist.runtime.in_job_steps import HUNG_WORDS, Step

STOP_WAIT_S = 10.0  # how long the ranks of a killed step on live nodes may take to end
SETTLE_S = 5.0  # a rank ended: how long srun may take to end the step before the nodes are checked
FAILED_SETTLE_S = 1.0  # a rank's job failed: how long a process may take to be seen ending before the nodes are checked
SILENT_S = 2.0  # a rank that says nothing this long after another died or failed is stuck (in a collective) or hung
KILL_WAIT_S = 5.0  # how long a hung rank told to end itself may take (one stuck in native code cannot)
PICKLE_WAIT_S = 60.0  # as the task runner: submitit puts the job's pickle in place just after sbatch
STOP_EXIT = 3  # the supervisor's exit status when the job cannot go on (as the node failure check's)


@dataclass
class Failure:
    """Why the steps are suspect: an exit status (None: still running), the nodes already found
    dead with their evidence (None: not checked yet), and the ranks srun saw end by a signal, each
    with its node (a candidate for an in-place restart)."""

    returncode: int | None
    dead: dict[str, str] | None = None
    why: str = ""
    signalled: dict[int, str] | None = None  # ranks srun saw end by a signal ({}: none, every rank raised)
    hung: bool = False  # a hung rank did not end itself: the step starts again whole
    faulty: dict[str, str] | None = None  # the nodes whose own rank died by a signal (not of a peer's hang), and how


class Supervisor:
    """Runs the job's ranks as srun steps on its live nodes, and again without a node that died;
    a rank whose process died on a live node is started again alone, the others in their processes."""

    def __init__(self, srun: Sequence[str], job_id: str, nodes: Sequence[str], batch_node: str, want: int,
                 floor: int, tasks_per_node: int, mark: Callable[[str, str, int], None], links: Links,
                 give_up: Callable[[str], int], max_in_place: int, alone: bool = False,
                 slurmds: dict[str, tuple[str, int]] | None = None) -> None:
        self.srun, self.job_id, self.want, self.floor, self.tasks = list(srun), job_id, want, floor, tasks_per_node
        self.nodes = list(nodes)  # Slurm's order: the ranks of a step are placed in it
        self.order = [n for n in nodes if n != batch_node] + [n for n in nodes if n == batch_node]
        self.active = self.order[:want]
        self.dead: set[str] = set()
        self.restarts = 0
        self.running: list[Step] = []  # this restart's sruns: the ranks' step, and those of ranks started again
        self.mark = mark
        self.give_up = give_up  # what ends the supervisor when the job cannot go on here: a requeue, or the end
        self.budget = Budget(max_in_place)  # in-place restarts allowed in any hour, and taken
        self.alone = alone  # such a rank starts again alone, the others in their processes (on_rank_failure)
        self.links = links
        self.slurmds = slurmds or {}  # each node's slurmd address, as Slurm gave it when the job began
        self.faults = Faults()  # each live node's deaths of a rank by a signal, when
        self.reaped: list[subprocess.Popen[bytes]] = []  # scancels still waiting for Slurm's answer

    # ------------------------------------------------------------------ the steps

    def launch(self) -> None:
        """The ranks' step on the active nodes (every step before it has ended)."""
        n = len(self.active)
        _say(f"in-job step {self.restarts} on {','.join(self.active)} ({n * self.tasks} ranks) at {time.time():.3f}")
        self.running = [self._srun(self.active, n * self.tasks, list(range(n * self.tasks)), {})]

    def _srun(self, nodes: list[str], tasks: int, ranks: list[int], extra: dict[str, str]) -> Step:
        """One srun of `ranks` on `nodes`. A task's end is the supervisor's to judge (srun kills no
        other task for it, now or ``WaitTime`` later: the survivors of an in-place restart go on);
        each rank's log is appended to, never truncated, by every run of it; a step of one rank
        started again writes that rank's log, not task 0's."""
        args = self.srun[1:] if len(ranks) != 1 or ranks == [0] else [a.replace("%t", str(ranks[0]))
                                                                      for a in self.srun[1:]]
        argv = [self.srun[0], f"--nodes={len(nodes)}", f"--ntasks={tasks}", f"--nodelist={','.join(nodes)}",
                "--overlap", "--kill-on-bad-exit=0", "--wait=0", "--open-mode=append", *args]
        env = {**os.environ, IN_JOB_RESTART_VAR: str(self.restarts), SUPERVISOR_VAR: self.links.address,
               KEEP_STATE_VAR: "1" if self.alone else "0", "SLURM_NTASKS": str(tasks), "SLURM_NPROCS": str(tasks),
               **extra}
        return Step(subprocess.Popen(argv, env=env, stderr=subprocess.PIPE), ranks)

    def again_in_place(self, ended: dict[int, str]) -> None:
        """The ranks in `ended` (rank: node) started again alone, each on its node; every other rank
        told to run the job again in its process, under the next restart number."""
        self.take_restart()
        world = len(self.active) * self.tasks
        nodes = ",".join(sorted(self.active, key=self.nodes.index))
        for step in self.running:
            step.replaced |= set(ended) & set(step.ranks)
        for rank, node in sorted(ended.items()):  # a step each: its log is the rank's own
            self.running.append(self._srun([node], 1, [rank], {IN_PLACE_VAR: f"{rank};{world};{nodes};{self.tasks}"}))
        who = (f"rank {','.join(map(str, sorted(ended)))} started again alone, the others in their processes"
               if ended else "every rank runs the job again in its process")
        _say(f"in-job step {self.restarts} on {','.join(self.active)} ({world} ranks) at {time.time():.3f}: {who} "
             f"({self.budget.line()})")
        self.links.tell(f"again {self.restarts}")

    def take_restart(self) -> None:
        self.budget.take()
        self.restarts += 1

    def watch(self) -> Failure:
        """Until every step ended (its exit status), a node is suspect, or the ranks to start again
        are known: those srun saw end by a signal, and those still silent ``SILENT_S`` after the
        first sign (a death, or another rank's failed collective), told to end themselves."""
        ended_at: float | None = None  # a rank's process ended, and srun has not said how
        failed_at: float | None = None  # the first sign that ranks must start again
        killed_at: float | None = None  # silent ranks were told to end themselves
        killed: set[int] = set()  # which
        checked = False  # the nodes were checked since this watch began
        succeeded: set[int] = set()  # the ranks that said (signed) that their job succeeded
        while True:
            for step in self.running:
                if step.proc.poll() is not None:
                    step.relay.join(5.0)  # srun's last lines read: its report of every failed task
            failures = {r: end for step in self.running for r, end in step.failures().items()}
            codes = [r for r, (_, how) in failures.items() if not how]
            if codes:  # a rank's own failure (an exception, a bug): the job's, as without spares
                node = failures[codes[0]][0]
                return Failure(1, why=f"rank {codes[0]} on {node} exited with an error")
            signalled = {r: node for r, (node, _) in failures.items()}
            faulty = {node: how for node, how in failures.values() if not how.startswith(HUNG_WORDS)}
            why = (f"rank {min(failures)} on {failures[min(failures)][0]} ended by a signal "
                   f"({failures[min(failures)][1]})" if failures else "every rank's communication failed")
            if signalled and not self.alone:
                return Failure(None, why=why, signalled=signalled, faulty=faulty)
            if all(step.proc.returncode is not None for step in self.running):
                code = max((s.proc.returncode or 0) for s in self.running if not s.replaced)
                succeeded |= {link.rank for _, link, _ in self.links.events(0.5, self.active, self.restarts)
                              if link.done}  # a rank's last line may come after srun's end
                if code and not failures and succeeded >= set(range(len(self.active) * self.tasks)):
                    _say(f"warning: srun exited {code} after every rank said that its job succeeded (srun's own "
                         f"errors are above: its ports are open to anyone on the node): the job succeeded")
                    code = 0
                return Failure(code, why=f"srun exited {code}")
            for sock, rank, error in self.links.events(0.5, self.active, self.restarts):
                if rank.done:
                    succeeded.add(rank.rank)
                if error is not None and error.errno in (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    return Failure(None, None, f"the connection of a rank on {rank.node or '?'} timed out "
                                   f"({error.strerror})")
                if sock is None and not rank.done:  # a rank's process ended before its job did
                    ended_at = ended_at or time.monotonic()
                elif rank.failed:
                    failed_at = failed_at or time.monotonic()
            now = time.monotonic()
            if signalled:
                failed_at = failed_at or now
            if killed_at is not None and now - killed_at > KILL_WAIT_S:  # stuck in native code, it could not
                return Failure(None, why="a silent rank did not end on its supervisor's word", hung=True)
            if ended_at is not None and not signalled:  # srun says how; a node that died first is found here
                if not checked and now - ended_at > (FAILED_SETTLE_S if failed_at is not None else SETTLE_S):
                    checked = True
                    found = self.check(self.active)
                    if found:
                        return Failure(None, found, "a rank ended and its step did not")
                continue
            if failed_at is None or (now - failed_at <= FAILED_SETTLE_S and not signalled):
                continue
            if not checked and not signalled:
                checked = True
                found = self.check(self.active)
                if found:
                    return Failure(None, found, "a rank's job failed")
            ranks = self.links.ranks()
            if any(r.failed == "own" for r in ranks):  # an exception of the job's code while every node lives
                self.links.tell("stop")  # the rank ends with its error, srun reports its exit code: the job's failure
                failed_at = None
                continue
            silent = [r for r in ranks if not r.failed and not r.done]  # said nothing: stuck in a collective, or hung
            if not silent and killed <= set(signalled):  # every rank told to end did, as srun reports
                return Failure(None, why=why, signalled=signalled, faulty=faulty)
            if killed_at is None and now - failed_at > SILENT_S:
                if not self.alone:
                    return Failure(None, why=f"rank {','.join(str(r.rank) for r in silent)} said nothing", hung=True)
                _say(f"in-job: rank {','.join(str(r.rank) for r in silent)} said nothing {SILENT_S:g} s after "
                     f"{why if signalled else 'the others failed'}: stuck or hung, it ends itself and starts again")
                self.links.tell("kill", silent)
                killed, killed_at = {r.rank for r in silent}, now

    # ------------------------------------------------------------------ the nodes

    def check(self, nodes: Sequence[str]) -> dict[str, str]:
        """Those of `nodes` that are dead, each with its evidence (``in_job_faults.dead``)."""
        return dead(nodes, self.slurmds)

    def stop(self, live: set[str]) -> None:
        """Every step's ranks killed, and its srun (which would wait for a dead node until Slurm
        declares it down); returns once the ranks on the `live` nodes closed their connections
        (or after ``STOP_WAIT_S``). scancel itself is not waited for: Slurm answers it only once
        it gave up on the dead node."""
        from hpcdist.scheduler import slurm

        steps = self.links.steps or {s for s in (slurm.job_steps(self.job_id) or set()) if s.isdigit()}
        for step_id in sorted(steps):
            self.reaped.append(slurm.kill_step(self.job_id, step_id))
        for step in self.running:
            step.proc.kill()
            step.proc.wait()
        deadline = time.monotonic() + STOP_WAIT_S
        while self.links.connected(live) and time.monotonic() < deadline:
            self.links.events(0.2, self.active, self.restarts)
        self.links.close_all()
        self.reaped = [p for p in self.reaped if p.poll() is None]

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        self.launch()
        while True:
            failure = self.watch()
            if failure.returncode == 0:
                return 0
            noticed = time.time()
            dead = failure.dead
            if dead is None and (failure.signalled is not None or failure.hung):  # a rank died by a signal, or hung
                dead = self.check(sorted(set((failure.signalled or {}).values()))) or (
                    self.faults.repeated(failure.faulty or {}) if self.spares() else {})
                if not dead and self.budget.allows():
                    if failure.hung or not self.alone:  # every rank in a new process: the step starts again whole
                        self.stop(set(self.active))
                        self.take_restart()
                        _say(f"in-job: {failure.why} while every node answers: the step starts again on the same "
                             f"nodes ({self.budget.line()})")
                        self.launch()
                    else:
                        self.again_in_place(failure.signalled or {})
                    continue
                if not dead:
                    _say(f"in-job: {failure.why} while every node answers, and the job took the "
                         f"{self.budget.per_hour} in-place restarts an hour that the site's "
                         f"preemption.in_job_restarts_per_hour allows: the job ends (raise it to allow more)")
                    failure.returncode = 1
            dead = dead if dead is not None else self.check(self.active)
            if not dead:
                if failure.returncode is None:
                    _say(f"warning: {failure.why}, but every node of the step answers: going on")
                    continue
                self.stop(set())  # the job's own failure (an exit code): every node answers
                return failure.returncode
            self.stop({n for n in self.active if n not in dead})
            for node, why in dead.items():
                how = "is moved off: its ranks go to a spare" if self.faults.repeats(node) else "died"
                _say(f"in-job: node {node} {how} ({why}; {failure.why}) noticed at {noticed:.3f}")
                self.mark(node, why, restart_count(os.environ) + 1)
            self.dead |= set(dead)
            line = self.replace(set(dead))
            if line:
                return self.give_up(line)
            self.restarts += 1
            self.launch()

    def spares(self) -> list[str]:
        """The nodes held for the job that run no rank and are not known dead, in the order they are given."""
        return [n for n in self.order if n not in self.active and n not in self.dead]

    def replace(self, dead: set[str]) -> str:
        """The next step's nodes: the live ones and live spares; "" when it can run, else why not."""
        survivors = [n for n in self.active if n not in dead]
        spares = self.spares()
        gone = self.check(spares) if spares else {}
        for node, why in gone.items():
            _say(f"in-job: spare {node} is dead too ({why})")
            self.mark(node, why, restart_count(os.environ) + 1)
        self.dead |= set(gone)
        live = [n for n in spares if n not in gone]
        self.active = sorted(survivors + live[:self.want - len(survivors)], key=self.order.index)
        if len(self.active) >= self.floor:
            if len(self.active) < self.want:
                _say(f"in-job: no live spare left: the job goes on on {len(self.active)} of its {self.want} nodes "
                     f"(resources.min_nodes={self.floor})")
            return ""
        names = ", ".join(sorted(dead))
        return (f"node {names} died and the job has no live spare left; it may not run on fewer than "
                f"{self.floor} nodes and {len(self.active)} live remain")


def _say(line: str) -> None:
    print(f"hpcdist: {line}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m hpcdist.runtime.in_job FOLDER -- srun ...``: the batch script's launch of a job
    with spare nodes (FOLDER is submitit's, where the job's pickle holds its spec and site)."""
    from hpcdist.errors import BootstrapError
    from hpcdist.runtime import node_failure
    from hpcdist.runtime.agent import SIGNAL_VAR, keep_alive_on
    from hpcdist.runtime.group import own_address
    from hpcdist.runtime.in_job_link import job_key
    from hpcdist.runtime.node_failure import submitted
    from hpcdist.scheduler.hostlist import expand_hostlist
    from hpcdist.scheduler.slurm_cluster import slurmd_addresses

    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m hpcdist.runtime.in_job FOLDER -- srun ...", file=sys.stderr)
        return 2
    keep_alive_on(os.environ.get(SIGNAL_VAR))  # the site's preemption signal is the ranks' to act on
    try:
        job_id, spec, site, _, _ = submitted(args[0], os.environ, wait_s=PICKLE_WAIT_S)
    except Exception as exc:  # noqa: BLE001 - one line: the ranks could not read it either
        _say(f"error: the in-job supervisor cannot read the job from {args[0]}: {type(exc).__name__}: {exc}")
        return 1
    res = spec.resources
    nodes = expand_hostlist(os.environ["SLURM_JOB_NODELIST"])
    here = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    paths = spec.paths(site, job_id)

    def mark(node: str, why: str, run: int) -> None:
        for problem in node_failure.record_in_job(job_id, site, paths, node, why, run):
            _say(f"warning: {problem}")

    def give_up(line: str) -> int:
        ends = node_failure.no_spare_left(job_id, spec, site, paths, line, restart_count(os.environ) + 1)
        if not ends:
            _say(f"in-job: {line}: requeued (on_node_failure: requeue); the job runs again from its last "
                 f"checkpoint once {res.nodes + res.spare_nodes} nodes are free")
            time.sleep(120)  # Slurm ends this batch step
        else:
            print(STOPPED + ends, file=sys.stderr, flush=True)
        return STOP_EXIT

    try:
        key = job_key(args[0], os.environ)
    except BootstrapError as exc:
        key, why = None, str(exc)
    else:
        why = f"no key file for job {job_id} in {args[0]}"
    if key is None:
        _say(f"error: the in-job supervisor signs its line to the ranks with the job's key: {why}; submit the job "
             f"again")
        return 1
    slurmds = slurmd_addresses(nodes)
    address = own_address(site.network.socket_ifname, False)
    links = Links(address, key, node_addresses(nodes, slurmds) | {address}, world=res.nodes * res.tasks_per_node)
    supervisor = Supervisor(args[2:], job_id, nodes, here, res.nodes, res.min_nodes or res.nodes, res.tasks_per_node,
                            mark, links, give_up, site.preemption.in_job_restarts_per_hour,
                            spec.on_rank_failure == "in_place", slurmds)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
