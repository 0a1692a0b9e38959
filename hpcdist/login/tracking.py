"""The job's experiment-tracker run, made once at submit (login side): the one place a run starts.

A job that names trackers (``JobSpec.trackers``) gets a run identity in its tracking folder
(``JobPaths.tracking``) before it is queued. A requeue never comes back here (same job, same
folder); a resubmission of the same spec that resumes its checkpoints reuses the identity, so
MLflow, W&B and TensorBoard see one run per job; one that starts afresh (no checkpoint) gets a
new run. The MLflow run is created here, on the login node, with the MLflow client: its id must
exist before any rank (or an unchanged script reading ``MLFLOW_RUN_ID``) starts. After the job,
``wandb_sync_command`` is W&B's own sync of the job's offline folders (``hpcdist track sync``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote

from hpcdist.config.tracking import (
    IDENTITY_FILE,
    Identity,
    Tracking,
    not_installed_message,
    read_identity,
    settled_identity,
)
from hpcdist.errors import JobError, SubmitError

if TYPE_CHECKING:
    from hpcdist.config.paths import JobPaths
    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec

# How long submit waits for an MLflow server (the client's own default retries for minutes).
MLFLOW_TIMEOUT_S = 15


def check_installed(spec: JobSpec, site: Site, tracking: Tracking | None = None) -> None:
    """One SubmitError when the job names a tracker whose package is not installed."""
    missing = (tracking or spec.trackers(site)).missing()
    if missing:
        raise SubmitError(f"job {spec.name!r}: {not_installed_message(missing)}")


def prepare(spec: JobSpec, site: Site) -> Identity | None:
    """The job's run identity, written to its tracking folder: the one it has when it resumes its
    checkpoints under the same trackers, else a new one. None when the job names no tracker."""
    tracking = spec.trackers(site)
    if not tracking.names:
        return None
    check_installed(spec, site, tracking)
    paths = spec.paths(site)

    def new() -> Identity:
        identity = Identity(key=uuid.uuid4().hex[:16], name=spec.name, created=time.time(), git_commit=_git_commit())
        if tracking.mlflow is not None:
            _mlflow_run(identity, tracking, spec)
        if tracking.wandb is not None:
            w = tracking.wandb
            identity.wandb_project, identity.wandb_entity, identity.wandb_mode = w.project, w.entity or "", w.mode
        return identity

    return settled_identity(paths.tracking, tracking, spec.name, _resumes(paths), new)


def _resumes(paths: JobPaths) -> bool:
    """Whether the job will resume: its checkpoint folder holds a checkpoint (the job's own check
    of which one verifies comes on the node; a run that starts afresh anyway keeps the run)."""
    try:
        return any(p.name.startswith("step_") for p in paths.checkpoints.iterdir())
    except OSError:
        return False


def _git_commit() -> str:
    """The commit of the current folder's git checkout ("" outside one, or without git)."""
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


@contextlib.contextmanager
def _bounded_client() -> Iterator[None]:
    """The MLflow client's requests fail within MLFLOW_TIMEOUT_S instead of its minutes of retries."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="1", MLFLOW_HTTP_REQUEST_TIMEOUT=str(MLFLOW_TIMEOUT_S))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _mlflow_run(identity: Identity, tracking: Tracking, spec: JobSpec) -> None:
    """Create the job's MLflow run (and its experiment, the first time) on the tracking server."""
    assert tracking.mlflow is not None
    uri, experiment = tracking.mlflow.uri, tracking.mlflow.experiment or spec.name
    from hpcdist._version import __version__

    try:
        with _bounded_client():
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found is not None else client.create_experiment(
                experiment, artifact_location=_artifacts_beside(uri, experiment))
            run = client.create_run(experiment_id, run_name=spec.name, tags={
                "hpcdist.job_name": spec.name, "hpcdist.kind": spec.kind, "hpcdist.version": __version__,
                "hpcdist.run_key": identity.key, "hpcdist.git_commit": identity.git_commit})
    except Exception as exc:
        raise SubmitError(f"job {spec.name!r}: could not create its MLflow run on {uri} (experiment "
                          f"{experiment!r}): {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; "
                          f"check tracking.mlflow.uri and that the server is up") from exc
    identity.mlflow_uri, identity.mlflow_experiment = uri, experiment
    identity.mlflow_experiment_id, identity.mlflow_run_id = experiment_id, run.info.run_id


def _artifacts_beside(uri: str, experiment: str) -> str | None:
    """Where a new experiment on a SQLite file keeps its runs' artifacts: beside that file, in
    ``mlartifacts/<experiment>`` (MLflow's own default is ``./mlruns`` of the submitting folder,
    which the nodes may not share). None for a server, whose own setting decides."""
    if not uri.startswith("sqlite:///"):
        return None
    database = Path(unquote(uri.removeprefix("sqlite:///")).split("?")[0]).absolute()
    return (database.parent / "mlartifacts" / re.sub(r"[^\w.-]", "_", experiment)).as_uri()


def wandb_offline_runs(folder: Path) -> list[Path]:
    """The job's W&B offline run folders under its tracking folder, oldest start first: one per
    start (W&B names each ``offline-run-<YYYYmmdd_HHMMSS>-<run id>[-N]`` and never reuses one)."""
    identity = read_identity(folder)
    if identity is None or not identity.wandb_project:
        raise JobError(f"{folder}: no W&B run here (no {IDENTITY_FILE} naming one): was the job submitted with "
                       f"tracking.wandb? Only such a job has offline runs to sync")
    pattern = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(identity.key)}(?:-(\d+))?")
    found = []
    for path in (folder / "wandb").glob("offline-run-*"):
        m = pattern.fullmatch(path.name)
        if m and path.is_dir():
            found.append(((m[1], int(m[2] or 0)), path))
    if not found:
        raise JobError(f"{folder / 'wandb'}: no offline folder of W&B run {identity.key}: the job has not started "
                       f"yet, or logs to W&B online (tracking.wandb.mode: {identity.wandb_mode or 'unset'})")
    return [path for _, path in sorted(found)]


def wandb_sync_command(folder: Path) -> list[str]:
    """W&B's own ``wandb sync`` over the job's offline folders in the order they started: W&B syncs
    the files of one run id one after another, in that order, into the one run."""
    runs = wandb_offline_runs(folder)
    wandb = Path(sys.executable).with_name("wandb")
    if not wandb.is_file():
        found = shutil.which("wandb")
        if found is None:
            raise JobError(f"no `wandb` command beside {sys.executable} or on PATH: pip install 'hpcdist[wandb]'")
        wandb = Path(found)
    return [str(wandb), "sync", *(str(p) for p in runs)]
