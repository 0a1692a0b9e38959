"""The CUDA device of a rank: one decision from what is visible, used by the bootstrap, the NCCL
group and the public API. No GPU here: torch's CUDA calls are stood in for, the environments are
the launchers' own tables."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hpcdist.config.spec import JobSpec
from hpcdist.errors import BootstrapError
from hpcdist.runtime import bootstrap, group
from hpcdist.runtime.device import cuda_index
from hpcdist.runtime.rankinfo import RankInfo
from tests.test_rankinfo import SRUN_RANK5

# srun --gpus-per-task=1 --gpu-bind=single:1 (or cgroup-constrained GPUs): task 5 sees one GPU
ONE_PER_TASK = {**SRUN_RANK5, "CUDA_VISIBLE_DEVICES": "1"}
# every GPU of the node visible to every task
ALL_FOUR = {**SRUN_RANK5, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
# srun --gpu-bind=closest: task 7 (local 3) sees its socket's two GPUs
CLOSEST_LOCAL3 = {**SRUN_RANK5, "SLURM_PROCID": "7", "SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "2,3"}
OPENMPI_LOCAL2 = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}


@pytest.mark.parametrize(("env", "torch_sees", "index"), [
    (ONE_PER_TASK, 1, 0),  # the one visible GPU is cuda:0, whatever the local rank
    (ALL_FOUR, 4, 1),  # local rank 1 of 4 with all four visible
    (OPENMPI_LOCAL2, 2, 0),  # two per task by UUID: local rank 2 mod 2
    ({**SRUN_RANK5, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 2, 1),  # torch dropped two invalid entries
    (SRUN_RANK5, 4, 1),  # no CUDA_VISIBLE_DEVICES: torch's count
])
def test_device_from_what_is_visible(env: dict[str, str], torch_sees: int, index: int) -> None:
    info = RankInfo.from_env(env, hostname="gpu08")
    assert cuda_index(info.local_rank, env, torch_sees) == index


def test_no_visible_device_is_a_bootstrap_error() -> None:
    seen = r"no CUDA device is visible to local rank 1 \(CUDA_VISIBLE_DEVICES='', torch sees 0\)"
    with pytest.raises(BootstrapError, match=seen):
        cuda_index(1, {"CUDA_VISIBLE_DEVICES": ""}, 0)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """torch.cuda as a node with `count` GPUs would show it; records the device NCCL is bound to."""
    seen: dict[str, Any] = {"count": 1}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: seen["count"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.__setitem__("bound", torch.device(d)))
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda **kw: seen.__setitem__("device_id", kw.get("device_id")))
    return seen


@pytest.mark.parametrize(("env", "count", "want"), [(ONE_PER_TASK, 1, "cuda:0"), (ALL_FOUR, 4, "cuda:1")])
def test_the_bound_device_is_the_chosen_one(fake_cuda: dict[str, Any], env: dict[str, str], count: int,
                                            want: str) -> None:
    fake_cuda["count"] = count
    spec = JobSpec.model_validate({"name": "t", "kind": "smoke", "backend": "nccl",
                                   "resources": {"nodes": 2, "tasks_per_node": 4, "gpus_per_node": 4}})
    info = RankInfo.from_env(env, hostname="gpu08")
    backend, device = bootstrap.choose_backend(spec, info, env)
    assert (backend, str(device)) == ("nccl", want)
    group.init_process_group(torch.distributed.HashStore(), info, backend, 5.0, device)
    assert str(fake_cuda["bound"]) == want and str(fake_cuda["device_id"]) == want


def test_ranks_beyond_the_shared_gpus_are_refused(fake_cuda: dict[str, Any]) -> None:
    fake_cuda["count"] = 2  # four ranks on the node, every rank sees the same two GPUs
    spec = JobSpec.model_validate({"name": "t", "kind": "smoke", "backend": "nccl",
                                   "resources": {"nodes": 2, "tasks_per_node": 4, "gpus_per_node": 2}})
    with pytest.raises(BootstrapError, match=r"4 ranks on gpu08 but only 2 GPUs visible"):
        bootstrap.choose_backend(spec, RankInfo.from_env(SRUN_RANK5, hostname="gpu08"), SRUN_RANK5)


def test_a_group_the_script_made_still_gets_the_chosen_device(fake_cuda: dict[str, Any],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """hpcdist.init() after the script's own init_process_group (no set_device of its own): the
    rank's device is made current before the object collectives, not left at cuda:0."""
    fake_cuda["count"] = 4
    spec = JobSpec.model_validate({"name": "t", "kind": "python", "backend": "nccl", "params": {"script": "x.py"},
                                   "resources": {"nodes": 2, "tasks_per_node": 4, "gpus_per_node": 4}})
    info = RankInfo.from_env(ALL_FOUR, hostname="gpu08")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_group", lambda: object())
    backend, device = bootstrap.choose_backend(spec, info, ALL_FOUR)
    assert str(bootstrap.adopt_device(device)) == "cuda:1"
    assert str(fake_cuda["bound"]) == "cuda:1"


def test_the_preflight_inside_a_gpu_allocation_measures_nccl(fake_cuda: dict[str, Any]) -> None:
    """`srun python -m hpcdist.runtime.entry jobs/bench_preflight.yaml` in a training job: the spec
    asks for no GPUs, but each rank has one, so its figures are NCCL's, comparable with the site's."""
    from hpcdist.config import load_site, load_spec

    spec = load_spec("jobs/bench_preflight.yaml", load_site("local"), ["resources.nodes=1"])
    assert spec.backend == "auto" and spec.resources.gpus_per_node == 0
    fake_cuda["count"] = 4  # every GPU of the node visible: local rank 1 of 4 takes cuda:1
    backend, device = bootstrap.choose_backend(spec, RankInfo.from_env(SRUN_RANK5, hostname="gpu08"), SRUN_RANK5)
    assert (backend, str(device)) == ("nccl", "cuda:1")
    fake_cuda["count"] = 0  # a CPU node: gloo, as before
    assert bootstrap.choose_backend(spec, RankInfo.from_env(SRUN_RANK5, hostname="cpu01"), SRUN_RANK5)[0] == "gloo"


@pytest.mark.parametrize(("env", "count", "local_rank"), [
    (ONE_PER_TASK, 1, "0"),  # --gpus-per-task=1 / --gpu-bind=single:1: cuda:0 in every task
    (CLOSEST_LOCAL3, 2, "1"),  # --gpu-bind=closest: this socket's two of four, the second
    (ALL_FOUR, 4, "1"),  # no binding: torchrun's case, LOCAL_RANK is the node-local rank
])
def test_a_torchrun_style_scripts_local_rank_is_its_gpu_however_the_site_binds(
        fake_cuda: dict[str, Any], env: dict[str, str], count: int, local_rank: str) -> None:
    """The python kind's LOCAL_RANK under each binding: `torch.cuda.set_device(int(LOCAL_RANK))`
    (examples/ddp_plain.py) names a GPU the task has, the one hpcdist chose; the node-local rank
    stays in HPCDIST_LOCAL_RANK. Before, local rank 1 asked for cuda:1 with one GPU visible."""
    from hpcdist.kinds.python_run import script_env

    fake_cuda["count"] = count
    spec = JobSpec.model_validate({"name": "t", "kind": "python", "backend": "nccl", "params": {"script": "x.py"},
                                   "resources": {"nodes": 2, "tasks_per_node": 4, "gpus_per_node": 4}})
    info = RankInfo.from_env(env, hostname="gpu08")
    _, device = bootstrap.choose_backend(spec, info, env)
    got = script_env(info, "10.0.0.1", 4000, "77", env, device)
    assert got["LOCAL_RANK"] == local_rank and int(local_rank) < count
    assert torch.device("cuda", int(got["LOCAL_RANK"])) == device
    assert got["HPCDIST_LOCAL_RANK"] == env["SLURM_LOCALID"]
