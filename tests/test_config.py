"""Site configs and job specs: the shipped ones load, and each bad input is one clear error."""

from pathlib import Path

import pytest

from hpcdist.config import load_site, load_spec, site_names
from hpcdist.errors import ConfigError
from hpcdist.kinds.registry import load_job
from hpcdist.kinds.smoke import SmokeParams
from tests.support.cli import REPO, run_cli

SMOKE = REPO / "jobs" / "smoke.yaml"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_sites_load() -> None:
    assert {"local", "local-slurm", "hdr-a100", "ndr-h100"} <= set(site_names())
    for name in ("hdr-a100", "ndr-h100"):
        site = load_site(name)
        gpu_parts = [p for p in site.partitions.values() if p.gpus_per_node in (4, 8)]
        assert gpu_parts and site.network.ib_hcas and site.network.link_rate_gbps in (200, 400)
        assert any(k.startswith("NCCL_") for k in site.env)
    h100 = load_site("ndr-h100")  # an HGX H100 node: 8 GPUs, one NDR400 compute NIC per GPU
    assert {p.gpus_per_node for p in h100.partitions.values()} == {8}
    assert len(h100.network.ib_hcas) == 8 and h100.env["NCCL_IB_HCA"].count("mlx5_") == 8


def test_local_is_the_default_site_where_srun_is_not_on_path(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    monkeypatch.delenv("HPCDIST_SITE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun: this is not a Slurm login node
    site = load_site(None)
    assert site.name == "local" and site.scheduler == "local"


def test_env_values_become_strings() -> None:
    assert load_site("local").env["OMP_NUM_THREADS"] == "1"


def test_unknown_site_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown site 'nope'; known sites: .*local-slurm"):
        load_site("nope")


def test_unknown_key_names_path_and_allowed_keys(tmp_path: Path) -> None:
    text = (REPO / "site_configs" / "local-slurm.yaml").read_text()
    text = text.replace("    gpus_per_node: 4", "    gpus_per_nod: 4")
    path = write(tmp_path, "s.yaml", text)
    with pytest.raises(ConfigError) as err:
        load_site(str(path))
    msg = str(err.value)
    assert str(path) in msg and "partitions.gpu.gpus_per_nod: unknown key" in msg
    assert "allowed keys: cpus_per_node, gpu_nodes, gpu_type, gpus_per_node" in msg


def test_wrong_type_names_value(tmp_path: Path) -> None:
    text = (REPO / "site_configs" / "local-slurm.yaml").read_text()
    text = text.replace("cpus_per_node: 8", "cpus_per_node: eight", 1)
    with pytest.raises(ConfigError, match=r"partitions\.cpu\.cpus_per_node: .*integer.*\(got 'eight'\)"):
        load_site(str(write(tmp_path, "s.yaml", text)))


def test_malicious_yaml_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = write(tmp_path, "evil.yaml", f"name: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="not valid YAML.*no !!python tags"):
        load_site(str(path))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["resources.partition=bigmem"], r"resources\.partition: 'bigmem' is not possible.*one of \['cpu', 'gpu'\]"),
        (["resources.partition=gpu", "resources.gpus_per_node=8", "resources.tasks_per_node=8"],
         r"resources\.gpus_per_node: 8 is not possible.*at most 4 on partition 'gpu'"),
        (["resources.partition=gpu", "resources.gpus_per_node=4", "resources.tasks_per_node=2"],
         r"resources\.tasks_per_node: 2 is not possible.*4 \(one rank per GPU"),
        (["resources.nodes=9"], r"resources\.nodes: 9 is not possible.*at most [2-8]"),
        (["resources.time_min=999"], r"resources\.time_min: 999 .*at most 60 min"),
        (["kind=smok"], r"kind: unknown job kind 'smok'; known kinds: .*smoke"),
        (["params.mpii=true"], r"params\.mpii: unknown key; allowed keys: label, mpi"),
        (["resources.nodes=0"], r"resources\.nodes: .*greater than or equal to 1 \(got 0\)"),
        (["backend=nccl"], r"backend: 'nccl' is not possible.*gloo or auto"),
    ],
)
def test_spec_against_site(sets: list[str], message: str) -> None:
    site = load_site("local-slurm")
    with pytest.raises(ConfigError, match=message):
        load_job(SMOKE, site, sets)


def test_overrides_apply_to_spec_and_site() -> None:
    site = load_site("local-slurm", ["launcher.args=[--mpi=none]", "defaults.timeout_s=5"])
    spec = load_spec(SMOKE, site, ["resources.nodes=2", "params.mpi=true"])
    assert site.launcher.line_args == ("--mpi=none",) and spec.timeout(site) == 60
    assert spec.resources.nodes == 2 and spec.params == {"mpi": True}


def test_job_params_are_parsed_once_into_the_kinds_model() -> None:
    job = load_job(SMOKE, load_site("local-slurm"), ["params.mpi=true"])
    assert type(job.params) is SmokeParams and job.params.mpi and job.uses_mpi
    assert job.spec.params == {"mpi": True}  # the spec keeps what the file said


def test_cli_error_is_one_line_without_traceback(tmp_path: Path) -> None:
    result = run_cli("render", str(SMOKE), "--site", "local-slurm", "--set", "resources.nodes=9")
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcdist: error: ") and "resources.nodes: 9" in lines[0]
    assert "Traceback" not in result.text
    debug = run_cli("--debug", "render", str(SMOKE), "--site", "local-slurm", "--set", "resources.nodes=9")
    assert "Traceback" in debug.err and debug.code != 0


def test_a_default_partition_the_site_lacks_is_one_short_line(tmp_path: Path) -> None:
    """Issue 55: it was one line of 1,171 characters holding the whole site as a dict."""
    text = (REPO / "site_configs" / "local-slurm.yaml").read_text().replace("partition: cpu", "partition: batch")
    path = write(tmp_path, "s.yaml", text)
    with pytest.raises(ConfigError) as err:
        load_site(str(path))
    said = "(top level): defaults.partition 'batch' is not one of the partitions ['cpu', 'gpu']"
    assert str(err.value) == f"{path}: {said}"


NUMBERED_SITE = """name: numbered
scheduler: slurm
partitions:
  "3090": {nodes: 2, cpus_per_node: 8, mem_gb: 16, gpus_per_node: 0, max_time_min: 60}
  "on": {nodes: 2, cpus_per_node: 8, mem_gb: 16, gpus_per_node: 0, max_time_min: 60}
storage: {results: /tmp/r, checkpoints: /tmp/c, scratch: /tmp/s, logs: /tmp/l}
"""


def test_a_partition_named_with_a_number_or_a_yaml_word_is_asked_for_by_its_name(tmp_path: Path) -> None:
    """`--set resources.partition=3090` (YAML reads an int) renders `--partition=3090`; a bare `on`
    (YAML reads True) is one line saying to quote it, and quoted it renders."""
    site = tmp_path / "numbered.yaml"
    site.write_text(NUMBERED_SITE)
    base = ("render", str(REPO / "jobs" / "smoke.yaml"), "--site", str(site))
    numbered = run_cli(*base, "--set", "resources.partition=3090")
    assert numbered.code == 0 and "#SBATCH --partition=3090\n" in numbered.out, numbered.text
    bare = run_cli(*base, "--set", "resources.partition=on")
    assert bare.code == 2 and len(bare.err.strip().splitlines()) == 1, bare.text
    assert "resources.partition: True is how YAML reads a bare on/off" in bare.err and "quote" in bare.err
    quoted = run_cli(*base, "--set", "resources.partition='on'")
    assert quoted.code == 0 and "#SBATCH --partition=on\n" in quoted.out, quoted.text
