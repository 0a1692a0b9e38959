"""A rank whose run failed under an in-job supervisor closes its process groups at once
(``hpcdist.runtime.teardown.drop``), so a survivor that waits on it inside a collective fails
then, instead of staying in its all-reduce until that rank's process ends (gloo's own
``abort()`` does not close the sockets; in-place restarts of train_gpt waited on such stuck
survivors). Three gloo ranks on this machine: rank 2 dies, rank 1 sees it and drops its groups
and then lives on; rank 0 waits on rank 1 in a ring all-reduce. Rank 0 must fail while rank 1
still lives."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from hpcdist.runtime.agent import free_port

RANK = textwrap.dedent("""
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    from hpcdist.runtime import teardown
    rank, port, out, drop = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "drop"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=120))
    t = torch.ones(4096)
    dist.all_reduce(t)
    if rank == 2:
        os._exit(9)
    if rank == 1:
        time.sleep(0.5)
        try:
            dist.all_reduce(t)
        except RuntimeError:
            if drop:
                teardown.drop()
        deadline = time.time() + (30 if drop else 3)  # lives on until rank 0 has said, or for 3 s
        while not os.path.exists(out + ".r0") and time.time() < deadline:
            time.sleep(0.05)
        open(out + ".r1end", "w").write(f"{time.time()}")
        os._exit(0)
    try:
        dist.all_reduce(t)
        said = "completed"
    except RuntimeError as exc:
        said = "failed " + str(exc).splitlines()[0][:100]
    open(out + ".r0", "w").write(f"{time.time()} {said} {dist.is_initialized()}")
    os._exit(0)
""")


def _run(tmp_path: Path, mode: str) -> tuple[str, bool]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    out = tmp_path / mode
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(out), mode]) for r in range(3)]
    for proc in procs:
        proc.wait(timeout=120)
    said = (tmp_path / f"{mode}.r0").read_text()
    r1_ended = float((tmp_path / f"{mode}.r1end").read_text())
    return said, float(said.split()[0]) < r1_ended


def test_a_survivor_waiting_on_a_rank_that_dropped_its_groups_fails_while_it_lives(tmp_path: Path) -> None:
    said, before = _run(tmp_path, "drop")
    assert " failed " in said, said
    assert before, f"rank 0 went on waiting until rank 1's process ended: {said}"


def test_without_the_drop_the_survivor_waits_for_the_process_to_end(tmp_path: Path) -> None:
    """The peer the drop is measured against: what happens without it (the cause it fixes)."""
    said, before = _run(tmp_path, "keep")
    assert not before, f"rank 0 failed while rank 1 still lived, without the drop: {said}"
