"""``hpcdist track sync JOBID``: a job's W&B offline runs sent to W&B from the login node.

W&B offline writes one folder per start of the job (each preemption and requeue starts again),
all of one run id; this runs W&B's own ``wandb sync`` over them in the order they started, which
continues the one run (``hpcdist.login.tracking.wandb_sync_command``). ``--print`` shows the
command and runs nothing.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
from typing import Any

from hpcdist.errors import JobError


def add_parser(subs: Any) -> None:
    from hpcdist.cli.jobs import job_site_arg

    p = subs.add_parser("track", help="a job's experiment-tracker run: sync its W&B offline runs")
    tsubs = p.add_subparsers(dest="track_command", required=True)
    sync = tsubs.add_parser("sync", help="`wandb sync` over the job's W&B offline folders, in the order they started")
    sync.add_argument("job_id", help="the id `hpcdist submit` printed")
    sync.add_argument("--print", "--dry-run", dest="dry_run", action="store_true",
                      help="print the folders and the command, run nothing")
    job_site_arg(sync)


def cmd_track(args: argparse.Namespace) -> int:
    from hpcdist.login.jobhandle import JobHandle
    from hpcdist.login.tracking import wandb_sync_command

    handle = JobHandle.find(args.job_id, args.site)
    command = wandb_sync_command(handle.submission.paths.tracking)
    print(f"job {handle.job_id} ({handle.record.name}): {len(command) - 2} W&B offline folder(s) of one run, "
          f"oldest first")
    print(shlex.join(command), flush=True)
    if args.dry_run:
        return 0
    try:
        return subprocess.run(command, check=False).returncode
    except OSError as exc:
        raise JobError(f"could not run {command[0]}: {exc}; "
                       f"check the wandb install (pip install 'hpcdist[wandb]')") from exc
