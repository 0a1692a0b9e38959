"""The local site's job controller: submitit's, with two launch facts fixed before any rank starts.

- The job's folder is named by its id before anything is created in it: submitit's controller
  makes the folder from its ``%j`` pattern first, which left a literal ``%j`` folder beside
  every job's logs.
- Every start of the ranks gets a fresh launch id (``LAUNCH_ID_VAR``): the local job id is this
  controller's PID, which the system reuses, and a requeue restarts the ranks under the same
  PID, so the id alone would let ranks find an older launch's rendezvous file. It also counts
  the starts (``LOCAL_RESTARTS_VAR``), as Slurm's restart count does: the checkpoint claim tells
  a requeue of the job from a second run of it by that count; and it sets the start's launch
  time (``LAUNCH_TIME_VAR``), as the Slurm script does before each run's launcher.
- A job given ``LOCAL_AFTER_VAR`` (an array item beyond ``max_parallel``) waits for that job's
  controller to end before its ranks first start.
- The job's store key (``hpcdist.runtime.signed_store``) is made in its folder before its ranks
  first start: the job id, this controller's PID, is known only here.
- It hears SIGINT however it was started. A shell without job control (a script's ``cmd &``,
  ``nohup``, many CI runners) starts background commands with SIGINT ignored, and Python keeps an
  ignore it inherits: the SIGINT of ``hpcdist cancel`` (submitit's own cancel) then stopped
  nothing, and the cancel killed the job after its grace instead. Its ranks, started after the
  handler is set, begin with SIGINT at its default, as in a terminal.

``hpcdist.login.submit`` starts it as ``python -m hpcdist.runtime.local_controller FOLDER`` where
submitit starts ``submitit.local._local``; everything else is submitit's.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path

from submitit.local.local import Controller

from hpcdist.config.contract import LAUNCH_ID_VAR, LAUNCH_TIME_VAR, LOCAL_AFTER_VAR, LOCAL_RESTARTS_VAR
from hpcdist.launchers import SAFE_PATH, SUBMITIT_RUNNER
from hpcdist.runtime.signed_store import make_key
from hpcdist.scheduler.local_jobs import controller_alive


class JobController(Controller):
    starts = 0

    def start_tasks(self) -> None:
        self.folder = Path(str(self.folder).replace("%j", self.pid))
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.starts == 0:  # a requeue keeps it; a folder an earlier job of this reused PID left gets a new one
            make_key(self.folder, self.pid)
        after = os.environ.pop(LOCAL_AFTER_VAR, "")
        if after and self.starts == 0:  # an array item's slot: the item before it ends first
            pid, _, started = after.partition(":")
            while controller_alive(pid, int(started) if started else None):
                time.sleep(0.5)
        os.environ[LAUNCH_ID_VAR] = uuid.uuid4().hex
        os.environ[LAUNCH_TIME_VAR] = repr(time.time())  # this start's, as the Slurm script exports it per run
        os.environ[LOCAL_RESTARTS_VAR] = str(self.starts)  # the local requeue's count, as Slurm's SLURM_RESTART_COUNT
        self.starts += 1
        # each task through hpcdist's runner: submitit's behind the trust check, its result pickle 0600
        self.command = [SUBMITIT_RUNNER if part == "submitit.core._submit" else part for part in self.command]
        if "-m" in self.command and not set(SAFE_PATH) & set(self.command):  # no working folder first on its path
            at = self.command.index("-m")
            self.command[at:at] = list(SAFE_PATH)
        super().start_tasks()


def main() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # before submitit's own SIGTERM handler
    JobController(Path(sys.argv[1])).run()


if __name__ == "__main__":
    main()
