"""The `local` site: no Slurm, ranks as processes through submitit's LocalExecutor."""

from __future__ import annotations

import re

import h5py

from hpcdist.store.results import read_attrs, read_table
from tests.support.cli import result_path, run_cli


def test_smoke_on_local_site(local_storage: list[str]) -> None:
    result = run_cli("submit", "jobs/smoke.yaml", "--site", "local", "--wait", *local_storage)
    assert result.code == 0, result.text
    assert "2/2 ranks succeeded" in result.out
    path = result_path(result.out)
    attrs = read_attrs(path)
    assert attrs["kind"] == "smoke" and attrs["world_size"] == 2 and attrs["complete"]
    assert attrs["site"] == "local" and attrs["spec"]["name"] == "smoke"
    assert attrs["version_torch"].startswith("2.")
    with h5py.File(path) as f:
        assert f.attrs["sum"] == 1.0
        table = read_table(f["bootstrap"])
    assert list(table["rank"]) == [0, 1]
    assert (table["init_process_group_s"] >= 0).all() and (table["import_torch_s"] > 0).all()
    # nothing half-written is left beside the result
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_local_rank_that_never_joins_is_named(local_storage: list[str]) -> None:
    result = run_cli(
        "submit", "jobs/smoke.yaml", "--site", "local", "--wait", *local_storage,
        "--set", "timeout_s=5", "--set", "env.HPCDIST_FAULT_EXIT_RANK=1",
    )
    assert result.code == 1
    assert re.search(r"rank 0: FAILED BootstrapError: rendezvous: rank\(s\) 1 of 2 did not join within 5 s", result.out)


def test_report_shows_every_table_of_a_result(local_storage: list[str]) -> None:
    result = run_cli("submit", "jobs/smoke.yaml", "--site", "local", "--wait", *local_storage)
    path = result_path(result.out)
    report = run_cli("report", str(path))
    assert report.code == 0, report.err
    assert "job smoke (smoke)" in report.out and "2 ranks on 1 node(s)" in report.out
    assert "/bootstrap: 2 row(s)" in report.out and "launch_to_ready_s" in report.out
    rows = [ln.split() for ln in report.out.splitlines() if ln.strip().startswith(("0 ", "1 "))]
    assert [r[0] for r in rows] == ["0", "1"] and all(len(r) == 7 for r in rows)
