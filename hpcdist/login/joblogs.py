"""`hpcdist logs JOBID`: a job's per-rank logs, found from the job id alone through the index.

A rank's logs are the stdout and stderr files its launcher wrote (submitit's ``%j_%t_log.out``
and ``.err``; hpcdist's log lines are in the ``.err``). Where the launcher wrote no per-rank
files (mpirun puts every rank in the batch step's files), hpcdist's own rank logs
(``train_rank1.log``) stand in. ``-f`` follows the files while the job runs and ends when the
scheduler says the job ended; ``--tail K`` starts from the last K lines of each file.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path

from hpcdist.errors import SubmitError
from hpcdist.login import remote
from hpcdist.login.jobhandle import JobHandle
from hpcdist.login.jobindex import JobRecord, lookup
from hpcdist.scheduler.slurm import Vanished

POLL_S = 0.5
STATE_EVERY_S = 2.0


def _ranks(record: JobRecord, rank: int | None, every: bool) -> list[int]:
    if every:
        return list(range(record.tasks))
    rank = 0 if rank is None else rank
    if not 0 <= rank < record.tasks:
        raise SubmitError(f"job {record.job_id} has ranks 0-{record.tasks - 1}; --rank {rank} is not one of them")
    return [rank]


class _Printer:
    """Lines to stdout, with a ``==> label: path <==`` header whenever the file changes (as tail)."""

    def __init__(self, headers: bool) -> None:
        self.headers, self.current = headers, ""

    def lines(self, label: str, path: Path, lines: list[str]) -> None:
        if not lines:
            return
        if self.headers and label != self.current:
            sys.stdout.write(f"{chr(10) if self.current else ''}==> {label}: {path} <==\n")
            self.current = label
        sys.stdout.write("".join(line if line.endswith("\n") else line + "\n" for line in lines))
        sys.stdout.flush()


def _tail(path: Path, keep: int | None) -> tuple[list[str], int]:
    """The file's lines (the last `keep` of them) and the offset of its end."""
    with path.open("rb") as f:
        lines = deque(f, maxlen=keep) if keep is not None else list(f)
        end = f.tell()
    return [line.decode(errors="replace") for line in lines], end


def show(record: JobRecord, ranks: list[int], tail: int | None) -> None:
    """Print the logs of `ranks` as they are now."""
    printer = _Printer(headers=True)
    missing = []
    for rank in ranks:
        files = record.rank_files(rank)
        if not files:
            missing.append(rank)
        for label, path in files:
            printer.lines(label, path, _tail(path, tail)[0])
    if missing and len(missing) == len(ranks):
        state = JobHandle(record).state
        if not state.final:
            raise SubmitError(f"job {record.job_id} has written no logs yet ({state.value}); "
                              f"follow them with `hpcdist logs {record.job_id} -f`")
        raise SubmitError(f"no log files for rank(s) {missing} of job {record.job_id} in {record.folder} "
                          f"(job {state.value}); were they moved or removed?")


def follow(record: JobRecord, ranks: list[int], tail: int | None) -> None:
    """Print the logs of `ranks` as they grow, until the job has ended and its files are read."""
    printer = _Printer(headers=True)
    offsets: dict[Path, int] = {}
    partial: dict[Path, bytes] = {}

    def drain(final: bool) -> None:
        if record.scheduler == "slurm" and remote.active():
            remote.fetch_record(record)
        for rank in ranks:
            for label, path in record.rank_files(rank):
                if path not in offsets:  # first sight: start from its last `tail` lines (all by default)
                    lines, offsets[path] = _tail(path, tail)
                    printer.lines(label, path, lines)
                    continue
                with path.open("rb") as f:
                    f.seek(offsets[path])
                    data = partial.pop(path, b"") + f.read()
                    offsets[path] = f.tell()
                head, sep, rest = data.rpartition(b"\n")
                if rest and not final:
                    partial[path] = rest  # a line still being written
                    data = head + sep
                printer.lines(label, path, data.decode(errors="replace").splitlines(keepends=True))

    from hpcdist.login.watch import hurry

    checked, vanished, reading = float("-inf"), Vanished(), None
    while True:
        drain(final=False)
        if time.monotonic() - checked >= STATE_EVERY_S:
            checked = time.monotonic()
            handle = JobHandle(record)
            if record.scheduler == "slurm" and handle.submission.job.task(0).paths.result_pickle.exists():
                hurry()  # rank 0 returned: Slurm's word on the end comes next
            reading, heard = handle.reading(), reading.asked if reading is not None else -1.0
            # squeue answered without it, and sacct is down: it ended (a kept answer is no second one)
            gone = reading.asked != heard and vanished.gone(reading)
            if reading.state.final or gone:
                time.sleep(1.0)  # the last lines a node flushes as the job ends
                drain(final=True)
                if gone:
                    print(f"hpcdist: {Vanished.message(record.job_id, 'the logs above are all there is')}",
                          file=sys.stderr)
                return
        time.sleep(POLL_S)


def cmd_logs(args: argparse.Namespace) -> int:
    record = lookup(args.job_id, args.site)
    ranks = _ranks(record, args.rank, args.all)
    if args.tail is not None and args.tail < 0:
        raise SubmitError(f"--tail {args.tail}: give a number of lines, 0 or more")
    if record.scheduler == "slurm" and remote.active():  # `--on HOST`: the logs as the cluster has them now
        remote.fetch_record(record)
    from hpcdist.login.jobhandle import attach
    from hpcdist.login.standby import runs  # a job with spares: the runs its standby jobs took over too

    sub = attach(record)
    for run in runs(record, sub.spec, sub.site, following=args.follow):
        if args.follow:
            follow(run, ranks, args.tail)
        else:
            show(run, ranks, args.tail)
    return 0
