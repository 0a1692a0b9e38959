"""``hpcdist site init`` and ``hpcdist site check``: a site config written from the live Slurm
cluster, and every claim of one checked against it (``hpcdist.config.discovered``,
``hpcdist.login.site_check``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from hpcdist.errors import ConfigError

# What only a compute node knows, from one short step: its InfiniBand HCAs, GPU model, local scratch.
PROBE = ("echo ib_hcas=$(ls /sys/class/infiniband 2>/dev/null); "
         "echo gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs); "
         "echo tmp=${TMPDIR:-/tmp} $(df -h --output=size,fstype ${TMPDIR:-/tmp} 2>/dev/null | tail -1 | xargs)")


def _probe(partition: str) -> dict[str, str]:
    from hpcdist.scheduler.slurm_cluster import step

    ran = step(["-N1", "-n1", f"--partition={partition}", "--time=2"], ["sh", "-c", PROBE], 180)
    if ran.code is None:
        raise ConfigError(f"--probe: `srun -N1 -p {partition}` got no node within 180 s; run again without "
                          f"--probe, or when the partition has a free node")
    if ran.code:
        raise ConfigError(f"--probe: `srun -N1 -p {partition}` exited {ran.code}: {ran.err.strip()[:300]}")
    found = dict(line.split("=", 1) for line in ran.out.splitlines() if "=" in line)
    return {k: v.strip() for k, v in found.items() if v.strip()}


def cmd_site(args: argparse.Namespace) -> int:
    return {"init": _init, "check": _check}[args.action](args)


def _init(args: argparse.Namespace) -> int:
    from hpcdist.config import Site, safe_load, validate
    from hpcdist.config.discovered import site_text, user_sites_dir
    from hpcdist.scheduler.slurm_cluster import read_cluster

    cluster = read_cluster()
    path = Path(args.output) if args.output else user_sites_dir() / f"{args.name or cluster.name}.yaml"
    if path.exists() and not args.force:
        raise ConfigError(f"{path} exists; pass --force to write over it, or -o FILE to write elsewhere")
    default = cluster.default_partition
    probe = _probe(default.name) if args.probe and default is not None else None
    text = site_text(cluster, path.stem, probe=probe)
    validate(Site, {**safe_load(text), "name": path.stem}, f"the site read from cluster {cluster.name!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(0o644)
    os.replace(tmp, path)
    ref = path.stem if path.parent == user_sites_dir() else str(path)
    print(f"wrote {path}: site {path.stem!r} from the Slurm cluster {cluster.name!r}; check it with "
          f"`hpcdist site check {ref}`, use it with --site {ref}")
    return 0


def _check(args: argparse.Namespace) -> int:
    """The site named; with none, the site a submit would use (``$HPCDIST_SITE``, else the
    cluster srun talks to, as read from it), and the one ``hpcdist site init`` wrote, when it
    wrote exactly one."""
    if args.site:
        return _check_one(args.site, args, "")
    refs: list[tuple[str | None, str]] = [(None, "the site a submit uses where none is named")]
    if not os.environ.get("HPCDIST_SITE"):
        import shutil

        from hpcdist.config.discovered import user_sites_dir
        from hpcdist.scheduler import ssh

        if shutil.which("srun") is None and not ssh.login():  # `--on HOST`: the cluster behind that login node
            raise ConfigError("site check: no site named, and no Slurm here (srun is not on PATH): name the Slurm "
                              "site to check, `hpcdist site check NAME` (a name or a YAML file)")
        written = sorted(user_sites_dir().glob("*.yaml"))
        if len(written) == 1:
            refs.append((str(written[0]), f"written by `hpcdist site init`: {written[0]}"))
        elif written:
            print(f"hpcdist: note: {len(written)} sites written by `hpcdist site init` "
                  f"({', '.join(p.stem for p in written)}); `hpcdist site check NAME` checks one", file=sys.stderr)
    return max(_check_one(ref, args, f" ({what})") for ref, what in refs)


def _check_one(ref: str | None, args: argparse.Namespace, what: str) -> int:
    from hpcdist.config import load_site
    from hpcdist.console import table, text
    from hpcdist.login.site_check import check
    from hpcdist.scheduler.slurm_cluster import read_cluster

    site = load_site(ref)
    if site.scheduler != "slurm":
        raise ConfigError(f"site {site.name!r}{what} is a {site.scheduler} site: site check compares a Slurm site "
                          f"with its cluster; name one, `hpcdist site check NAME`")
    cluster = read_cluster()
    claims = check(site, cluster, storage=not args.no_storage)
    grid = table("claim", "the site says", "the cluster", "", left=4)
    for claim in claims:
        grid.add_row(claim.key, claim.says, claim.cluster, {True: "ok", False: "WRONG", None: "not checked"}[claim.ok])
    sys.stdout.write(f"site {site.name!r}{what} against the Slurm cluster {cluster.name!r}:\n" + text(grid))
    wrong = [c for c in claims if c.ok is False]
    for claim in wrong:
        print(f"hpcdist: wrong: {claim.line(site.name)}", file=sys.stderr)
    if wrong:
        return 1
    if args.preflight:
        return _preflight(ref, min(2, site.partition(None)[1].nodes))
    return 0


def _preflight(site: str | None, nodes: int) -> int:
    """The preflight job (jobs/bench_preflight.yaml's) on the site, through ``hpcdist submit --wait``."""
    import json
    import tempfile

    from hpcdist.cli import main

    spec = {"name": "site-check-preflight", "kind": "bench_preflight", "timeout_s": 60,
            "resources": {"nodes": nodes, "tasks_per_node": 1, "time_min": 5},
            "params": {"paths": ["torch"], "sizes_bytes": ["1M", "16M"], "pair_size": "4M", "iters": 10, "warmup": 2}}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "preflight.yaml"
        path.write_text(json.dumps(spec))
        return main(["submit", *(["--site", site] if site else []), "--wait", str(path)])


def add_parser(subs: Any) -> None:
    p = subs.add_parser("site", help="write a site config from the live Slurm cluster, or check one against it")
    p.set_defaults(action=None)
    ssubs = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    init = ssubs.add_parser("init", help="a site config read from the cluster srun talks to, each value with "
                                         "where it came from")
    init.add_argument("name", nargs="?", help="the site's name (default: the cluster's, ClusterName)")
    init.add_argument("-o", "--output", help="the file to write (default ~/.config/hpcdist/sites/NAME.yaml, "
                                             "which --site NAME finds)")
    init.add_argument("--probe", action="store_true", help="also run one short step on a node: its InfiniBand "
                                                           "HCAs, GPU model, local scratch")
    init.add_argument("--force", action="store_true", help="write over an existing file")
    check = ssubs.add_parser("check", help="every claim of a site config checked against the live cluster")
    check.add_argument("site", nargs="?", help="a site name or YAML file (default: the site a submit uses where "
                                               "none is named, and the one `site init` wrote, when it wrote one)")
    check.add_argument("--no-storage", action="store_true", help="skip the storage check (it runs a 2-node step)")
    check.add_argument("--preflight", action="store_true", help="then run the preflight job on the site")
