"""Experiment trackers a job names (``tracking:`` in the job spec, the site's as a default), and the
run identity one job keeps across its requeues and resubmissions (both sides).

The login side makes the identity once at submit (``hpcdist.login.tracking``) and writes it to
``JobPaths.tracking``; every rank reads it back: the node side's trackers (``hpcdist.track``)
log to that run, and ``environment`` gives an unchanged script the variables the trackers' own
clients read (``MLFLOW_RUN_ID``, ``WANDB_RUN_ID``, ...), so each restart continues the same run.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlparse

from pydantic import Field, field_validator

from hpcdist.config.base import Frozen

IDENTITY_FILE = "run.json"  # in JobPaths.tracking
TENSORBOARD_DIR_VAR = "HPCDIST_TENSORBOARD_DIR"  # TensorBoard has no variable of its own: hpcdist names one
# what each tracker needs installed (its extra: pip install 'hpcdist[NAME]') and imports only when named
MODULES = {"mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb"}
# W&B writes its offline file from its own process (wandb-core), every 15 s by default; Slurm's
# SIGTERM (a requeue, a preemption) ends that process at once, so what it had not written is lost.
# Every second instead: a start loses at most its last second (W&B's private setting, by its variable).
WANDB_FLUSH_VAR, WANDB_FLUSH_S = "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL", "1"


class MlflowTracking(Frozen):
    """An MLflow tracking server: its URI and the experiment (default: the job's name)."""

    uri: str = Field(min_length=1, description="the tracking server, e.g. http://mlflow.example:5000, or a "
                     "SQLite file on shared storage, sqlite:////shared/mlflow/mlflow.db")
    experiment: str | None = Field(default=None, description="the experiment; default the job's name")

    @field_validator("uri")
    @classmethod
    def _not_a_file_store(cls, value: str) -> str:
        """MLflow's file store (a ``file:`` URI or a bare path) is refused here, before submit: MLflow 3
        keeps it in maintenance mode and opens it only under the opt-out ``MLFLOW_ALLOW_FILE_STORE``,
        which the login node and every rank would need; a SQLite file on the same shared storage
        does what it did (one file, no server, a run that continues across restarts)."""
        parsed = urlparse(value)
        if parsed.scheme not in ("", "file"):
            return value
        path = unquote(parsed.path).rstrip("/")
        folder = path if path.startswith("/") else "<a shared folder>"
        raise ValueError(f"MLflow's file store, which MLflow 3 no longer opens (maintenance mode); on a shared file "
                         f"system use a SQLite file there, sqlite:///{folder}/mlflow.db (no server; a requeued job "
                         f"continues its run), or a tracking server's http:// address")


class WandbTracking(Frozen):
    """Weights & Biases: the project, and online (needs the nodes to reach the server) or offline."""

    project: str = Field(min_length=1)
    entity: str | None = None
    mode: Literal["online", "offline"] = "offline"


class Tracking(Frozen):
    """The trackers a job logs to: any of MLflow, TensorBoard (event files under the job's
    tracking folder) and W&B."""

    mlflow: MlflowTracking | None = None
    tensorboard: bool = False
    wandb: WandbTracking | None = None

    @property
    def names(self) -> list[str]:
        return [n for n, on in (("mlflow", self.mlflow), ("tensorboard", self.tensorboard), ("wandb", self.wandb))
                if on]

    def over(self, base: Tracking | None) -> Tracking:
        """This job's trackers over the site's default (each tracker the job names replaces the site's)."""
        if base is None:
            return self
        mine = self.model_dump(exclude_unset=True)
        return Tracking.model_validate({**base.model_dump(exclude_unset=True), **mine})

    def missing(self) -> list[str]:
        """The named trackers whose package is not installed here (nothing is imported)."""
        return [n for n in self.names if not _installed(MODULES[n])]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module blocked in sys.modules (None) is not there either
        return False


def not_installed_message(missing: list[str]) -> str:
    extras = ",".join(missing)
    return (f"tracking names {', '.join(missing)}, not installed in this Python: pip install 'hpcdist[{extras}]' "
            f"(on the login node and in the nodes' Python), or drop it from tracking:")


@dataclass
class Identity:
    """One job's run in its trackers, made once at submit: what every restart logs to."""

    key: str  # hpcdist's own id of the run (a W&B run id as it is)
    name: str  # the job's name: the run's display name
    created: float
    job_ids: list[str] = field(default_factory=list)  # the jobs that logged to it (submissions that resumed)
    mlflow_uri: str = ""
    mlflow_experiment: str = ""
    mlflow_experiment_id: str = ""
    mlflow_run_id: str = ""
    wandb_project: str = ""
    wandb_entity: str = ""
    wandb_mode: str = ""
    git_commit: str = ""  # of the folder the job was submitted from, when it is a git checkout

    def matches(self, tracking: Tracking, name: str) -> bool:
        """Whether this run is the one `tracking` asks for (a changed server or project starts a new one)."""
        m, w = tracking.mlflow, tracking.wandb
        same_mlflow = m is None or (self.mlflow_uri == m.uri and self.mlflow_experiment == (m.experiment or name))
        same_wandb = w is None or (self.wandb_project == w.project and self.wandb_mode == w.mode)
        return self.name == name and same_mlflow and same_wandb and (m is None or bool(self.mlflow_run_id))


def identity_path(folder: Path) -> Path:
    return folder / IDENTITY_FILE


def read_identity(folder: Path) -> Identity | None:
    """The job's run identity in its tracking folder (``JobPaths.tracking``), or None (none, or
    unreadable). Read only when no other user could have written it (``hpcdist.files.trust``: a
    file left in a folder that was once the group's would send her metrics and credentials to
    whoever wrote it): UntrustedFileError names it otherwise."""
    from hpcdist.files.trust import read_trusted

    try:
        data = json.loads(read_trusted(identity_path(folder), limit=1 << 20))
        return Identity(**data)
    except (OSError, ValueError, TypeError):
        return None


def write_identity(folder: Path, identity: Identity) -> None:
    """Write it whole or not at all, readable by the user only: a temporary name no one can guess,
    made with O_EXCL and written without following a link (``hpcdist.files.atomic``), then renamed."""
    from hpcdist.files.atomic import atomic_path

    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with atomic_path(identity_path(folder), mode=0o600) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        try:
            os.write(fd, json.dumps(asdict(identity), indent=1).encode())
        finally:
            os.close(fd)


def settled_identity(folder: Path, tracking: Tracking, name: str, resumes: bool,
                     new: Callable[[], Identity]) -> Identity:
    """The job's run identity for this submission: the one in `folder` when the job `resumes` its
    checkpoints under the same trackers and name (one run across requeues and resubmissions),
    else `new()`, written there in its place."""
    known = read_identity(folder)
    if known is not None and resumes and known.matches(tracking, name):
        return known
    identity = new()
    write_identity(folder, identity)
    return identity


def environment(tracking: Tracking, identity: Identity | None, folder: Path) -> dict[str, str]:
    """The variables that point the trackers' own clients at the job's run: an unchanged script that
    calls ``mlflow.start_run()`` or ``wandb.init()`` continues the same run after a requeue."""
    if identity is None:
        return {}
    env: dict[str, str] = {}
    if tracking.mlflow is not None and identity.mlflow_run_id:
        env.update(MLFLOW_TRACKING_URI=identity.mlflow_uri, MLFLOW_RUN_ID=identity.mlflow_run_id,
                   MLFLOW_EXPERIMENT_NAME=identity.mlflow_experiment)
    if tracking.wandb is not None:
        env.update(WANDB_RUN_ID=identity.key, WANDB_RESUME="allow", WANDB_DIR=str(folder),
                   WANDB_PROJECT=identity.wandb_project, WANDB_MODE=identity.wandb_mode, WANDB_NAME=identity.name)
        env[WANDB_FLUSH_VAR] = WANDB_FLUSH_S
        if identity.wandb_entity:
            env["WANDB_ENTITY"] = identity.wandb_entity
    if tracking.tensorboard:
        env[TENSORBOARD_DIR_VAR] = str(tensorboard_dir(folder))
    return env


def tensorboard_dir(folder: Path) -> Path:
    """The one event-file folder of the job's run (``purge_step`` drops what a restart logs again)."""
    return folder / "tensorboard"
