"""Every path of one job, in one value object (submitit's ``utils.JobPaths``, for hpcdist).

Built from the site's storage, the job's name and its id (``%j`` before Slurm gives one; an
array task's ``ARRAYID_INDEX``), each path through ``under``, so no name or id can leave its
storage root. Render, submit, the job index, the status line, the nodes' bootstrap, the
training loop, the code snapshot and the executor ask it; nothing else joins these paths.

A job array's tasks share one submitit folder, named after the array's base spec
(``folder_name``), while each task's progress and results are under the task's own name.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from hpcdist.config.site import Storage, current_user, under

UNSUBMITTED = "%j"  # the job id in a path made before the scheduler gave one (Slurm's pattern)


def log_patterns(folder: Path, array: bool = False) -> tuple[str, str]:
    """submitit's per-task stdout/stderr patterns in `folder` (``%j`` job id, ``%t`` task). In a
    job array submitit names each task ``ARRAYID_INDEX``, which Slurm's patterns spell ``%A_%a``."""
    out, err = str(folder / "%j_%t_log.out"), str(folder / "%j_%t_log.err")
    if array:
        out, err = out.replace("%j", "%A_%a"), err.replace("%j", "%A_%a")
    return out, err


def batch_node_died(folder: Path, job_id: str) -> Path:
    """``JobPaths.batch_node_died`` where only submitit's folder of job `job_id` is known (a rank)."""
    return folder / f"{job_id}_batch_node_died"


@dataclass(frozen=True)
class JobPaths:
    storage: Storage
    name: str  # the job's (a sweep task's) own name
    job_id: str = UNSUBMITTED
    folder_name: str = ""  # the name the submitit folder is made under, when not `name` (an array's base)
    own_folder: str = ""  # the job spec's `folder` (submitit's `folder`, ``%j`` the job id), when it names one

    @property
    def folder(self) -> Path:
        """submitit's folder for the job: its pickles, results and per-rank logs."""
        if self.own_folder:
            return Path(self.own_folder.replace(UNSUBMITTED, self.job_id))
        return under(self.storage.root("logs"), self.folder_name or self.name, self.job_id)

    def log_patterns(self, array: bool = False) -> tuple[str, str]:
        return log_patterns(self.folder, array)

    @property
    def store_key(self) -> Path:
        """The job's store key (``job_key``), in its submitit folder."""
        return job_key(self.folder, self.job_id)

    @property
    def progress(self) -> Path:
        """Where rank 0 reports progress and the waiter reads it: ``logs/<name>/<job id>``."""
        return under(self.storage.root("logs"), self.name, self.job_id)

    @property
    def container_home(self) -> Path:
        """The ranks' ``$HOME`` inside a container that gets one of its own: ``<scratch>/<name>/home``."""
        return under(self.storage.root("scratch"), self.name, "home")

    def rank_log(self, rank: int, what: str = "train") -> Path:
        """hpcdist's own log of one rank (``train_rank1.log``), beside the progress."""
        return self.progress / f"{what}_rank{rank}.log"

    @property
    def stacks_request(self) -> Path:
        """What `hpcdist stacks` (or a rank whose collective timed out) writes to ask every rank
        for its stack; each rank's watcher reads it (``hpcdist.runtime.stacks``)."""
        return self.progress / "stacks.request"

    def stack_file(self, rank: int) -> Path:
        """One rank's answer: its threads' stacks as JSON (``hpcdist.store.records.stackrecord``)."""
        return self.progress / f"stack_rank{rank}.json"

    def last_words(self, rank: int) -> Path:
        """What one rank said before its backend ended it (``hpcdist.store.records.last_error``): NCCL's
        watchdog aborts a rank whose collective timed out, and the summary reads this instead."""
        return self.progress / f"last_words_rank{rank}.json"

    @property
    def requeues(self) -> Path:
        """The runs that asked for their own requeue (a preemption, ``ctx.requeue()``), one line
        each (``hpcdist.runtime.requeue``): such a run ended by no node death."""
        return self.progress / "requeues.txt"

    @property
    def standby(self) -> Path:
        """The id of the job's standby job, queued behind it for its batch node's death
        (``hpcdist.runtime.standby``), once one is."""
        return self.folder / f"{self.job_id}_standby"

    @property
    def batch_node_died(self) -> Path:
        """The job's batch node, as a rank found it dead before the job was ended for its standby
        (``hpcdist.runtime.standby.supervisor_lost``): the node and why."""
        return batch_node_died(self.folder, self.job_id)

    @property
    def took_over(self) -> Path:
        """The id of the job this standby job took over (``hpcdist.runtime.standby``), once it did."""
        return self.folder / f"{self.job_id}_took_over"

    def result(self, suffix: str = "") -> Path:
        """``<results>/<name>/<job id><suffix>.h5``: where the job's result lands."""
        return under(self.storage.root("results"), self.name, f"{self.job_id}{suffix}.h5")

    @property
    def node_failures(self) -> Path:
        """Which nodes died under the job and were excluded when it ran again (``hpcdist.login.node_failure_wait``
        writes it, the result file and ``hpcdist jobs`` read it): beside the result."""
        return node_failure_record(self.result())

    @property
    def checkpoints(self) -> Path:
        """Stable across requeues and resubmissions of the same job name. A job whose checkpoints
        are still at the place of builds before per-user folders (``<root>/<name>``, made by this
        user) finds them there, so a job pending or requeued across the upgrade resumes."""
        new = under(self.storage.root("checkpoints"), self.name)
        old = under(self.storage.checkpoints, self.name)
        return old if new != old and not new.exists() and _own_folder(old, self.name) else new

    @property
    def tracking(self) -> Path:
        """The job's experiment-tracker run (``hpcdist.config.tracking``): its identity, made once at
        submit, TensorBoard's event files and W&B's offline run; stable across requeues and the
        resubmissions that resume, like the checkpoints: ``<logs>/<name>/tracking``."""
        return under(self.storage.root("logs"), self.name, "tracking")

    @property
    def rendezvous(self) -> Path:
        """Where rank 0 publishes its endpoint (one file per launch, removed after check-in): this
        user's own 0700 folder (``hpcdist.files.trust.private_folder``)."""
        return under(self.storage.root("scratch"), "rendezvous")

    def cache(self, name: str) -> Path:
        """Where torch or Triton keeps what it compiles (``hpcdist.runtime.caches``: ``torchinductor``
        for ``TORCHINDUCTOR_CACHE_DIR``, ...) unless the user set its variable: this user's own 0700
        folder in scratch, shared by her jobs, so a requeue reuses it."""
        return under(self.storage.root("scratch"), name)

    @property
    def calls(self) -> Path:
        """Where ``hpcdist.Executor`` puts the pickled calls of this job name."""
        return under(self.storage.root("logs"), self.name, "calls")

    def new_snapshot(self) -> Path:
        """A new folder for the code snapshot: ``<logs>/<name>/code-<time>-<random>``."""
        stamp = f"code-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        return under(self.storage.root("logs"), self.name, stamp)


def _own_folder(path: Path, name: str) -> bool:
    """`path` is a folder of this user's (not the per-user folder of a user called `name`)."""
    try:
        return name != current_user() and path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.geteuid()
    except OSError:
        return False


def job_key(folder: Path, job_id: str) -> Path:
    """The key that signs the job's messages in its rendezvous store (``hpcdist.runtime.signed_store``):
    ``<job id>_store.key``, 0600, beside submitit's pickles in the job's folder (`folder`, its id
    filled in), which may hold several jobs' files (an ``hpcdist.Executor`` folder without ``%j``)."""
    return folder / f"{job_id}_store.key"


def node_failure_record(result: Path) -> Path:
    """The node-failure record of the job whose result is `result`: ``<job id>.node_failures.json``."""
    return result.with_name(f"{result.stem}.node_failures.json")


def node_health(storage: Storage) -> Path:
    """The site's node health record (``hpcdist.store.records.health``): one folder for every user of the
    site, on shared storage beside the rendezvous files: ``<scratch>/node-health``."""
    return under(storage.scratch, "node-health")
