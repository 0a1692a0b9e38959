"""`hpcdist stacks JOBID`: where every rank of a running job is, grouped by identical stacks.

It asks the ranks through a file in the job's folder (``JobPaths.stacks_request``), which each
rank's watcher reads once a second (``hpcdist.runtime.stacks``: no signal, so it works the same
under srun, mpirun and torchrun, on Slurm and on the local site), waits a few seconds for one
answer per rank, and prints one line per group of ranks standing at the same frames:
``ranks 0-2: all_reduce, called at train.py:88``; ``-v`` every frame, ``--json`` everything.
The grouping is the one the summary of a job that timed out prints (``stackrecord.describe``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from hpcdist.errors import JobError


def add_parser(subs: Any) -> None:
    from hpcdist.cli.jobs import job_site_arg

    p = subs.add_parser("stacks", help="every rank's Python stack of a running job, grouped: where a hang is")
    p.add_argument("job_id", help="the id `hpcdist submit` printed")
    p.add_argument("-v", "--verbose", action="store_true", help="every frame of each group's stack")
    p.add_argument("--json", action="store_true", help="every rank's threads and frames, and the groups, as JSON")
    p.add_argument("--wait", type=float, default=5.0, metavar="S",
                   help="how long to wait for the ranks' answers (default 5 s; they look once a second)")
    job_site_arg(p)


def cmd_stacks(args: argparse.Namespace) -> int:
    from hpcdist.login.jobhandle import JobHandle
    from hpcdist.scheduler.states import JobState
    from hpcdist.store.records.stackrecord import ask, describe, elsewhere, group, stack_files, wait_answers

    if not args.wait > 0:
        raise JobError(f"--wait {args.wait:g}: give the seconds to wait for the ranks' answers, more than 0")
    handle = JobHandle.find(args.job_id, args.site)
    state = handle.state
    if state is not JobState.RUNNING:
        raise JobError(f"job {handle.job_id} is {state.value}, not RUNNING: only a running job's ranks answer; "
                       f"a job that timed out shows its ranks' stacks in `hpcdist wait {handle.job_id}`")
    paths, world = handle.submission.paths, handle.num_tasks
    try:
        request, asked = ask(paths, "asked")
    except OSError as exc:
        raise JobError(f"could not ask job {handle.job_id}'s ranks through {paths.stacks_request}: {exc}") from exc
    got = wait_answers(stack_files(paths, world), asked - 1.0, args.wait, request)
    if args.json:
        groups = group(got)
        print(json.dumps({
            "job_id": handle.job_id, "world_size": world, "request": request,
            "missing": [r for r in range(world) if r not in got],
            "groups": [g.to_dict() for g in groups], "elsewhere": elsewhere(groups),
            "notes": sorted({s.recorder for s in got.values() if s.recorder}),
            "ranks": {str(r): asdict(s) for r, s in sorted(got.items())},
        }, indent=1))
    else:
        print(f"job {handle.job_id} ({handle.record.name}): {len(got)}/{world} ranks answered")
        for line in describe(got, world, args.verbose):
            print(f"  {line}")
    return 0 if got else 1
