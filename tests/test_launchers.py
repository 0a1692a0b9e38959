"""Launchers by name: one registry, a duplicate name refused, an unknown kind named with the choices."""

from __future__ import annotations

import pytest

from hpcdist import launchers
from hpcdist.config import load_site
from hpcdist.errors import ConfigError
from hpcdist.runtime.rankinfo import RankInfo


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, launchers.Launcher]:
    """A copy of the registry, so a test's registrations vanish with it."""
    copy = dict(launchers._LAUNCHERS)
    monkeypatch.setattr(launchers, "_LAUNCHERS", copy)
    return copy


def test_builtin_launchers_per_scheduler() -> None:
    assert launchers.launcher_names("slurm") == ["srun", "mpirun", "torchrun"]
    assert launchers.launcher_names("local") == ["local"]


def test_duplicate_launcher_name_is_an_error(registry: dict[str, launchers.Launcher]) -> None:
    with pytest.raises(ValueError, match=r"launcher 'srun' is registered twice \(SrunLauncher, Other\)"):

        @launchers.register_launcher("srun")
        class Other(launchers.Launcher):
            pass

    assert type(registry["srun"]) is launchers.SrunLauncher


def test_duplicate_environment_table_is_an_error(registry: dict[str, launchers.Launcher]) -> None:
    with pytest.raises(ValueError, match=r"environment table\(s\) \['pmix', 'slurm'\] already belong"):

        @launchers.register_launcher("srun2")
        class Srun2(launchers.Launcher):
            env_tables = launchers.SrunLauncher.env_tables


def test_a_registered_launcher_is_usable_from_a_site(registry: dict[str, launchers.Launcher]) -> None:
    @launchers.register_launcher("flux")
    class Flux(launchers.Launcher):
        def command(self, plan: launchers.LaunchPlan) -> str:
            return f"flux run {plan.python}"

    site = load_site("local-slurm", ["launcher.kind=flux"])
    assert site.launcher.kind == "flux"


def test_unknown_launcher_kind_lists_the_registered_names() -> None:
    with pytest.raises(ConfigError) as err:
        load_site("local-slurm", ["launcher.kind=pbsdsh"])
    msg = str(err.value)
    assert "local-slurm.yaml" in msg and "launcher.kind" in msg and "'pbsdsh'" in msg
    assert "registered launchers: srun, mpirun, torchrun, local" in msg


def test_launcher_must_fit_the_scheduler() -> None:
    with pytest.raises(ConfigError, match=r"a slurm site cannot use launcher.kind 'local'; use 'srun' or 'mpirun'"):
        load_site("local-slurm", ["launcher.kind=local"])
    with pytest.raises(ConfigError, match=r"a local site cannot use launcher.kind 'srun'; use 'local'"):
        load_site("local", ["launcher.kind=srun"])


def test_each_table_has_one_owner_and_the_shim_fixes_slurm_variables() -> None:
    names = [t.name for t in launchers.env_tables()]
    assert names == ["torchrun", "env", "openmpi", "mpich", "pmix", "slurm", "submitit-local", "single"]
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "SLURM_PROCID": "0"}
    info = RankInfo.from_env(env, hostname="h")
    owner = launchers.owner_of(info.launcher)
    assert owner is not None and owner.name == "mpirun"
    assert owner.task_env(info) == {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
                                    "SLURM_NODEID": "1"}
    assert launchers.get_launcher("srun").task_env(info) == {}


def test_only_torchrun_ranks_are_all_store_clients() -> None:
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    assert RankInfo.from_env(torchrun, hostname="h").agent_store
    by_hand = {k: v for k, v in torchrun.items() if k != "TORCHELASTIC_RUN_ID"}
    assert not RankInfo.from_env(by_hand, hostname="h").agent_store
