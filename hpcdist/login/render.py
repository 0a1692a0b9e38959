"""Rendering: (job spec, site) -> the exact sbatch script ``submit`` hands to submitit.

A pure function: no I/O but reading the template (compiled once, into the user's cache), no
subprocess. Every value reaching the shell goes through one choke point, the Jinja2 ``finalize``
hook, which shell-quotes it; pieces that are shell by design (site setup lines, the launch line
built here from quoted parts) are marked ``Shell``. Any value with a control character is
refused first, with its key path: ``shlex.quote`` cannot make a newline safe inside a
``#SBATCH`` comment line.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcdist._paths import cache_dir, data_dir
from hpcdist._version import __version__
from hpcdist.config.contract import LAUNCH_TIME_VAR
from hpcdist.config.paths import log_patterns
from hpcdist.config.site import Site
from hpcdist.config.spec import JobSpec, plan_for
from hpcdist.containers import CONTAINER_VAR, SUBMITTED_WITH_VAR, ContainerPlan, get_runtime, versions
from hpcdist.errors import RenderError
from hpcdist.launchers import SUBMITIT_RUNNER, LaunchPlan, get_launcher

if TYPE_CHECKING:
    import jinja2

    from hpcdist.login.exclusions import Exclusions

TEMPLATE = "sbatch.sh.j2"
RESTART_CHECK = "hpcdist.runtime.node_failure"  # what the script runs before the launch of a requeued run
REQUEUE_ASKED = "hpcdist.runtime.requeue"  # what the script runs after ranks in a container asked for a requeue

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_FLAG = re.compile(r"^[a-z][a-z0-9-]*$")


class Shell(str):
    """Text that is shell on purpose and must not be quoted (it is still checked)."""


@dataclass(frozen=True)
class Origin:
    """How the user asked for this script, for the header's reproduce line."""

    job_path: str
    site_ref: str
    overrides: tuple[str, ...] = ()
    argv: tuple[str, ...] = ()  # `hpcdist submit ... -- SCRIPT ARG...`: the user's command
    after: tuple[str, ...] = ()  # job ids this job waits for (afterok): --after, or a chain's previous link
    sweeps: tuple[str, ...] = ()  # `--sweep KEY=V1,V2`: the job is an array, one task per combination
    max_parallel: int | None = None  # the array's %N
    tasks: int | None = None  # an array of this many tasks without sweeps (hpcdist.Executor.map_array)

    def command(self, verb: str = "submit") -> str:
        parts = ["hpcdist", verb, *([self.job_path] if not self.argv else []), "--site", self.site_ref]
        for item in self.overrides:
            parts += ["--set", item]
        for job_id in self.after:
            parts += ["--after", job_id]
        for item in self.sweeps:
            parts += ["--sweep", item]
        if self.max_parallel is not None and self.sweeps:
            parts += ["--max-parallel", str(self.max_parallel)]
        return shlex.join(parts + (["--", *self.argv] if self.argv else []))

    @property
    def array_size(self) -> int | None:
        """How many tasks the job array has (None: not an array)."""
        if not self.sweeps:  # the sweep module loads only for a sweep (every render asks this)
            return self.tasks
        from hpcdist.config.sweep import tasks

        return len(tasks(self.sweeps)) or self.tasks


def check_controls(value: Any, where: str) -> None:
    """Refuse control characters anywhere in a (nested) value, naming the key path."""
    if isinstance(value, str):
        match = _CONTROL.search(value)
        if match:
            raise RenderError(
                f"{where}: {value!r} contains the control character {match.group()!r}; "
                f"newlines and control characters cannot be put in a job script safely, remove it"
            )
    elif isinstance(value, dict):
        for k, v in value.items():
            check_controls(str(k), f"{where}.{k} (key)")
            check_controls(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_controls(v, f"{where}[{i}]")


def _finalize(value: Any) -> str:
    """The quoting choke point: every `{{ }}` in the template passes here."""
    text = "" if value is None else str(value)
    check_controls(text, "template value")
    if isinstance(value, Shell):
        return text
    return shlex.quote(text)


_ENV_OPTIONS: dict[str, Any] = {
    "autoescape": False, "trim_blocks": True, "lstrip_blocks": True, "keep_trailing_newline": True,
}


@functools.cache
def _environment() -> jinja2.Environment:
    """The one Jinja2 environment: templates compiled once per process, and kept compiled
    between runs in the user's cache (``_bytecode_cache``)."""
    import jinja2  # only a Slurm script needs it; a local site's plan is plain text

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
        undefined=jinja2.StrictUndefined,
        finalize=_finalize,
        bytecode_cache=_bytecode_cache(),
        **_ENV_OPTIONS,
    )


def _bytecode_cache() -> jinja2.BytecodeCache:
    """Jinja2's compiled templates in ``cache_dir("templates")``, so a render does not lex,
    parse and compile the template again (Jinja2 checks the template's checksum and its own
    and Python's versions; the file names add this environment's options, which change the
    compiled code too). A cache that cannot be read or written is passed over."""
    import jinja2

    class Cache(jinja2.FileSystemBytecodeCache):
        def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
            try:
                super().load_bytecode(bucket)
            except Exception:  # unreadable or damaged (Jinja2 checks the header only): compile again
                bucket.reset()

        def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
            try:
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                super().dump_bytecode(bucket)
            except OSError:
                pass

    options = repr(sorted({**_ENV_OPTIONS, "undefined": "StrictUndefined", "finalize": _finalize.__qualname__}.items()))
    return Cache(str(cache_dir("templates")), f"{hashlib.sha256(options.encode()).hexdigest()[:16]}-%s.cache")


def submitit_folder(spec: JobSpec, site: Site) -> Path:
    """Where submitit keeps this job's pickles and logs (``%j`` is the job id)."""
    return spec.paths(site).folder


def python_for(site: Site) -> str:
    return site.python or sys.executable


def directives(spec: JobSpec, site: Site, folder: Path, origin: Origin | None = None,
               excluded: Exclusions | None = None) -> list[tuple[str, Any]]:
    """The #SBATCH flags, in a fixed order; then the array and dependency `origin` asks for;
    site extras and the job's own ``sbatch:`` options (the job's win) last, sorted, with the
    nodes the site's health record keeps the job from added to its ``exclude`` (`excluded`)."""
    res = spec.resources
    partition, part = site.partition(res.partition)
    size = origin.array_size if origin else None
    out_pattern, err_pattern = log_patterns(folder, array=size is not None)
    err_pattern = out_pattern if spec.stderr_to_stdout else err_pattern
    extra = {**site.sbatch, **spec.sbatch}
    merged = excluded.flag() if excluded is not None else None
    if merged:
        extra["exclude"] = merged
    flags: list[tuple[str, Any]] = [
        ("job-name", spec.name),
        ("partition", partition),
        ("nodes", res.nodes),
        ("ntasks-per-node", res.tasks_per_node),
        ("cpus-per-task", spec.cpus_per_task(site)),
    ]
    if res.gpus_per_node:
        typed = f"{part.gpu_type}:{res.gpus_per_node}" if part.gpu_type else str(res.gpus_per_node)
        flags.append(("gres", f"gpu:{typed}") if site.gpu_request == "gres" else ("gpus-per-node", typed))
    if res.mem_gb is not None:
        flags.append(("mem", f"{int(res.mem_gb * 1024)}M"))
    flags.append(("time", slurm_time(spec.time_limit_min(site))))
    if site.account and "account" not in extra:
        flags.append(("account", site.account))
    if site.qos and "qos" not in extra:
        flags.append(("qos", site.qos))
    flags += [
        ("output", out_pattern.replace("%t", "0")),
        ("error", err_pattern.replace("%t", "0")),
        ("open-mode", "append"),
        ("signal", get_launcher(site.launcher.kind).signal_flag(
            site.preemption.signal, site.preemption.warning_s(60 * spec.time_limit_min(site)))),
        ("requeue", True),
    ]
    if size is not None:
        assert origin is not None
        flags.append(("array", f"0-{size - 1}" + (f"%{origin.max_parallel}" if origin.max_parallel else "")))
    if origin and origin.after:
        # afterok on each; a link that failed cancels this job instead of leaving it pending forever
        flags.append(("dependency", ",".join([*([str(extra.pop("dependency"))] if "dependency" in extra else []),
                                              *(f"afterok:{j}" for j in origin.after)])))
        flags.append(("kill-on-invalid-dep", extra.pop("kill-on-invalid-dep", "yes")))
    if spec.env_passthrough:
        flags.append(("export", _export(str(extra.pop("export", "ALL")), spec.env_passthrough)))
    flags += sorted(extra.items())
    for flag, _ in flags:
        if not _FLAG.match(flag):
            raise RenderError(f"sbatch flag {flag!r} is not a valid option name (lowercase letters, digits, '-')")
    return flags


def _export(site_value: str, names: tuple[str, ...]) -> str:
    """``--export`` that adds the job's pass-through names (never values) to the site's choice:
    ``ALL`` (Slurm's default) or a list stays as it is plus the names, ``NONE`` becomes the names."""
    listed = [] if site_value.upper() == "NONE" else [site_value]
    return ",".join([*listed, *names])


def launch_plan(spec: JobSpec, site: Site, folder: Path, array: bool = False,
                container: ContainerPlan | None = None) -> LaunchPlan:
    """What the site's launcher needs to write its launch line (each rank in `container`, if any)."""
    out_pattern, err_pattern = log_patterns(folder, array)
    err_pattern = out_pattern if spec.stderr_to_stdout else err_pattern
    box: dict[str, Any] = {}
    if container is not None:
        runtime = get_runtime(container.runtime)
        box = {"container": tuple(runtime.wrap(container)), "srun_container": tuple(runtime.srun_flags(container)),
               "rank_python": container.python}
    return LaunchPlan(
        python=python_for(site),
        folder=folder,
        tasks_per_node=spec.resources.tasks_per_node,
        stdout=out_pattern,
        stderr=err_pattern,
        args=site.launcher.line_args,
        cpus_per_task=spec.cpus_per_task(site),
        socket_ifname=site.network.socket_ifname,
        signal=site.preemption.signal,
        **box,
    )


def render_script(spec: JobSpec, site: Site, origin: Origin, excluded: Exclusions | None = None,
                  container: ContainerPlan | None = None) -> str:
    """The sbatch script text for `spec` on a Slurm `site`, kept off the `excluded` nodes, its
    ranks in `container` (by default the job's container, its binds as written)."""
    if site.scheduler != "slurm":
        raise RenderError(f"site {site.name!r} is not a Slurm site; it runs jobs without a script")
    check_controls(spec.model_dump(mode="json"), "job")
    check_controls(site.model_dump(mode="json"), "site")
    check_controls(list(origin.overrides), "--set")  # only reached by a value no key holds
    folder = submitit_folder(spec, site)
    launcher = get_launcher(site.launcher.kind)
    container = container or plan_for(spec, site)
    plan = launch_plan(spec, site, folder, array=origin.array_size is not None, container=container)
    env = {**spec.rank_env(site), "SUBMITIT_PREEMPTION_SIGNAL": site.preemption.signal}
    if container is not None:
        submitted_with = " ".join(f"{k}={v}" for k, v in versions().items())
        env |= {CONTAINER_VAR: container.runtime, SUBMITTED_WITH_VAR: submitted_with}
    context = {
        "version": __version__,
        "site_name": site.name,
        "job_name": spec.name,
        "job_kind": spec.kind,
        "reproduce": Shell(origin.command()),
        "directives": [(Shell(f), v if v is not True else True)
                       for f, v in directives(spec, site, folder, origin, excluded)],
        "notes": [Shell(line) for line in (excluded.lines() if excluded else [])],
        "modules": list(site.modules),
        "setup": [Shell(line) for line in site.setup],
        "env": sorted(env.items()),
        "prelude": [Shell(line) for line in launcher.prelude(plan)],
        "launch_time_var": Shell(LAUNCH_TIME_VAR),
        # Any job may run again on fewer nodes (hpcdist.login.node_failure_wait shrinks a pending one that resizes:
        # min_nodes, its kind, or hpcdist checkpoints found only then): Slurm keeps the submission's task
        # count in SLURM_NTASKS, which srun and mpirun read, so the script takes it from the run's nodes.
        "tasks_per_node": spec.resources.tasks_per_node,
        "launch": [Shell(line) for line in launcher.command(plan).splitlines()],
        # the ranks run in an image without Slurm's commands: the batch step asks for them
        "container": container.runtime if container else "",
        "image": container.image if container else "",
        "container_prelude": ([Shell(line) for line in get_runtime(container.runtime).prelude(container)]
                              if container else []),
        "requeue_asked": REQUEUE_ASKED,
        "runner": SUBMITIT_RUNNER,
        # after a requeue: hpcdist.runtime.node_failure decides, once per run, whether it may go on
        "python": Shell(plan.host()),
        "restart_check": RESTART_CHECK,
        "folder": str(folder),
    }
    import jinja2

    try:
        return _environment().get_template(TEMPLATE).render(**context)
    except jinja2.TemplateError as exc:
        raise RenderError(f"template {TEMPLATE}: {exc}") from exc


def render_local_plan(spec: JobSpec, site: Site, origin: Origin) -> str:
    """What a local-site submission will do (there is no script to show)."""
    # no script on this site: a folder with a newline (submitit allows one) is only a path here
    check_controls(spec.model_dump(mode="json", exclude={"folder"}), "job")
    res = spec.resources
    folder = submitit_folder(spec, site)
    env = spec.rank_env(site)
    lines = [
        f"# hpcdist {__version__}: site {site.name!r} runs jobs on this machine, without a scheduler",
        f"# Reproduce with: {origin.command()}",
        f"# submitit's LocalExecutor starts {res.tasks_per_node} process(es), one per rank:",
        f"#   {get_launcher(site.launcher.kind).command(launch_plan(spec, site, folder))}",
        f"# environment: {' '.join(f'{k}={shlex.quote(v)}' for k, v in sorted(env.items())) or '(none added)'}",
        *([f"# from your shell (values not shown): {' '.join(spec.env_passthrough)}"] if spec.env_passthrough else []),
        f"# time limit: {spec.time_limit_min(site):g} min; collective timeout: {spec.timeout(site):g} s",
    ]
    return "\n".join(lines) + "\n"


def slurm_time(minutes: float) -> str:
    """Slurm's ``--time`` for `minutes`: whole minutes as they are, a fraction as ``M:SS``
    (submitit's ``timeout_min`` may be ``3 / 60``), never less than a second."""
    if float(minutes).is_integer():
        return str(int(minutes))
    seconds = max(1, round(minutes * 60))
    return f"{seconds // 60}:{seconds % 60:02d}"


def render(spec: JobSpec, site: Site, origin: Origin, excluded: Exclusions | None = None,
           container: ContainerPlan | None = None) -> str:
    """What `hpcdist render` prints and `hpcdist submit` submits (`excluded`: ``plan.make``'s
    reading of the site's health record; `container`: its binds placed on the image)."""
    if site.scheduler == "slurm":
        return render_script(spec, site, origin, excluded, container)
    return render_local_plan(spec, site, origin)


def first_command_line(script: str) -> int:
    for i, line in enumerate(script.splitlines()):
        if line.strip() and not line.lstrip().startswith("#"):
            return i
    return -1


__all__: Sequence[str] = ("Origin", "render", "render_script", "submitit_folder", "check_controls")
