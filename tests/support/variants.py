"""The variant clusters (cluster/variants.sh): three small Slurm clusters beside the main one, each
set up as a kind of real site is. A client reaches one through ``variant_env(name)``'s SLURM_CONF:

- ``parts``: partitions ``batch`` (default, 30 min, 500 MB per CPU) and ``short`` (5 min, 250 MB)
- ``gpus``: typed GPUs on one node only (g1 ``gpu:a100:2``), MpiDefault=pmix, accounting enforced
  (alice and bob in account proj-b, QOS v-short of 20 minutes by default, v-sweep with
  MaxSubmitJobsPerUser=3 when asked), MaxArraySize=5
- ``noacct``: no accounting (sacct fails)"""

from __future__ import annotations

import os
import shutil
import subprocess

from tests.support.cli import missing

VARIANTS = ("parts", "gpus", "noacct")
VARIANTS_ETC = "/etc/slurm-variants"


def variant_env(name: str) -> dict[str, str]:
    """The environment a Slurm command needs to reach variant `name`."""
    if name not in VARIANTS:
        raise ValueError(f"no Slurm variant {name!r}; variants are {', '.join(VARIANTS)}")
    return {"SLURM_CONF": f"{VARIANTS_ETC}/{name}/slurm.conf"}


def require_variant(name: str) -> None:
    """Fail under `make test` (HPCDIST_REQUIRE_SLURM=1: make cluster-up starts the variants), skip
    elsewhere, when variant `name`'s controller does not answer."""
    env = variant_env(name)
    start = f"bash cluster/variants.sh up {name} (make cluster-up starts all three)"
    if shutil.which("scontrol") is None:
        missing(f"Slurm variant {name}: scontrol is not installed (make cluster-up)")
    if not os.path.exists(env["SLURM_CONF"]):
        missing(f"Slurm variant {name}: {env['SLURM_CONF']} is missing; start it with {start}")
    try:
        proc = subprocess.run(["scontrol", "ping"], env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=30, check=False)
        said = ((proc.stdout + proc.stderr).strip().splitlines() or ["no answer"])[0]  # not its banner
    except subprocess.TimeoutExpired:
        said = "scontrol ping timed out after 30 s"
    if "is UP" not in said:
        missing(f"Slurm variant {name}'s controller does not answer ({said[:200]}); start it with {start}")
