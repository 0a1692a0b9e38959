"""GPU buffers go to MPI only where it takes them: the library's own answer where mpi4py can ask
(``MPI.Query_cuda_support``), else the site's ``network.mpi_cuda_aware``; refused at submit while
the site says its MPI is not CUDA-aware. This machine's Open MPI (Debian's) cannot be asked, as on
the GPU machine of issue 40; the answers a CUDA-aware library would give are stood in for."""

from __future__ import annotations

from types import SimpleNamespace

import mpi4py
import pytest

# The test process must not start MPI: a singleton MPI_Init puts PMIX_RANK=0 into this process's
# environment, which every Slurm job it later submits (sbatch exports it) hands to each of its
# tasks, so that every task took itself for rank 0. The refusal is decided before any MPI call.
mpi4py.rc.initialize = False
mpi4py.rc.finalize = False

from mpi4py import MPI  # noqa: E402

from hpcdist.bench.mpi_path import MPIPath  # noqa: E402
from hpcdist.config import load_site  # noqa: E402
from hpcdist.errors import BenchmarkError, ConfigError  # noqa: E402
from hpcdist.kinds.registry import load_job  # noqa: E402
from tests.support.cli import REPO  # noqa: E402

WORLD = SimpleNamespace(Get_rank=lambda: 0, Get_size=lambda: 1)  # a communicator of one rank, no MPI started


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Sets what ``MPI.Query_cuda_support`` says (None: the library has no such call)."""
    def answer(says: bool | None) -> None:
        if says is None:
            monkeypatch.delattr(MPI, "Query_cuda_support", raising=False)
        else:
            monkeypatch.setattr(MPI, "Query_cuda_support", lambda: says, raising=False)
    return answer


def cuda_path(site_says: bool) -> MPIPath:
    return MPIPath(WORLD, "cuda", "cuda:0", cuda_aware=site_says)


def test_a_library_that_says_no_is_refused_whatever_the_site_says(library) -> None:  # type: ignore[no-untyped-def]
    library(False)
    with pytest.raises(BenchmarkError, match=r"not CUDA-aware \(MPI\.Query_cuda_support\(\) is false\); use "
                                             r"mpi_buffers: numpy"):
        cuda_path(site_says=True)


def test_a_library_that_cannot_be_asked_needs_the_sites_word(library) -> None:  # type: ignore[no-untyped-def]
    library(None)
    with pytest.raises(BenchmarkError) as err:
        cuda_path(site_says=False)
    text = str(err.value)
    assert "\n" not in text
    assert "network.mpi_cuda_aware is false" in text and "set network.mpi_cuda_aware: true" in text
    assert "use mpi_buffers: numpy" in text
    assert cuda_path(site_says=True).buffers == "cuda"


def test_a_library_that_says_yes_is_used(library) -> None:  # type: ignore[no-untyped-def]
    library(True)
    assert cuda_path(site_says=False).label == "mpi/cuda"


def test_numpy_buffers_need_nothing(library) -> None:  # type: ignore[no-untyped-def]
    library(False)
    assert MPIPath(WORLD, "numpy").label == "mpi/numpy"


GPU_JOB = ["resources.partition=gpu", "resources.gpus_per_node=4", "resources.tasks_per_node=4",
           "params.paths=[mpi]", "params.mpi_buffers=cuda"]


def test_submit_refuses_cuda_buffers_where_the_site_says_its_mpi_is_not_cuda_aware() -> None:
    site = load_site(str(REPO / "site_configs" / "local-slurm.yaml"))
    with pytest.raises(ConfigError) as err:
        load_job(REPO / "jobs" / "bench_collectives.yaml", site, GPU_JOB)
    text = str(err.value)
    assert "params.mpi_buffers: 'cuda' cannot run on site 'local-slurm'" in text and "\n" not in text
    assert "network.mpi_cuda_aware is false); use numpy, or set network.mpi_cuda_aware: true" in text
    site = load_site(str(REPO / "site_configs" / "local-slurm.yaml"), ["network.mpi_cuda_aware=true"])
    assert load_job(REPO / "jobs" / "bench_collectives.yaml", site, GPU_JOB).params.mpi_buffers == "cuda"
