"""MLflow without a server on a cluster: ``tracking.mlflow.uri: file://...`` (MLflow's file store,
which MLflow 3 refuses to open) is one line at submit naming the SQLite URI to use instead, and
that URI records the job's run, readable with MLflow's own client."""

from __future__ import annotations

from pathlib import Path

from tests.support.cli import REPO, run_cli, storage_sets

SCRIPT = REPO / "tests" / "scripts" / "track_steps.py"


def test_a_file_store_uri_is_refused_at_submit_naming_the_sqlite_uri(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/mlruns"
    result = run_cli("submit", "--site", "local", *storage_sets(tmp_path), "--set", f"tracking.mlflow.uri={uri}",
                     "--", str(SCRIPT))
    assert result.code == 2, result.text
    assert result.err == (
        f"hpcdist: error: command line: tracking.mlflow.uri: MLflow's file store, which MLflow 3 no longer opens "
        f"(maintenance mode); on a shared file system use a SQLite file there, sqlite:///{tmp_path}/mlruns/mlflow.db "
        f"(no server; a requeued job continues its run), or a tracking server's http:// address (got '{uri}')\n")
    assert not (tmp_path / "logs").exists() and not (tmp_path / "mlruns").exists()


def test_the_sqlite_uri_records_the_run_with_its_steps_and_artifact(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    result = run_cli("submit", "--site", "local", *storage_sets(tmp_path), "--set", f"tracking.mlflow.uri={uri}",
                     "--wait", "--", str(SCRIPT), timeout=180)
    assert result.code == 0, result.text
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("track_steps")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["hpcdist.job_name"] == "track_steps"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, 1 / s) for s in range(1, 6)]
    artifacts = tmp_path / "mlruns" / "mlartifacts" / "track_steps" / run.info.run_id / "artifacts"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == [p.name for p in artifacts.iterdir()]
    assert [p.suffix for p in artifacts.iterdir()] == [".h5"]
