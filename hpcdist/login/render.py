"""Rendering: a plan (``hpcdist.login.plan.Plan``) formatted into the exact sbatch script
``submit`` hands to submitit, or on a local site the text saying what it will run.

Every value is decided in the plan; this module only places them. A pure function: no I/O but
reading the template (compiled once, into the user's cache), no subprocess. Every value reaching
the shell goes through one choke point, the Jinja2 ``finalize`` hook, which shell-quotes it;
pieces that are shell by design (site setup lines, the launch line the launcher built from
quoted parts) are marked ``Shell``. Any value with a control character is refused first, with
its key path: ``shlex.quote`` cannot make a newline safe inside a ``#SBATCH`` comment line.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hpcdist._paths import cache_dir, data_dir
from hpcdist._version import __version__
from hpcdist.config.contract import LAUNCH_TIME_VAR
from hpcdist.errors import RenderError
from hpcdist.launchers import SUBMITIT_RUNNER
from hpcdist.login.plan import Plan, resolve

if TYPE_CHECKING:
    import jinja2

    from hpcdist.config.site import Site
    from hpcdist.config.spec import JobSpec
    from hpcdist.login.exclusions import Exclusions
    from hpcdist.login.plan import Origin

TEMPLATE = "sbatch.sh.j2"
RESTART_CHECK = "hpcdist.runtime.node_failure"  # what the script runs before the launch of a requeued run
REQUEUE_ASKED = "hpcdist.runtime.requeue"  # what the script runs after ranks in a container asked for a requeue

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_FLAG = re.compile(r"^[a-z][a-z0-9-]*$")


class Shell(str):
    """Text that is shell on purpose and must not be quoted (it is still checked)."""


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


def script(plan: Plan) -> str:
    """What `hpcdist render` prints and `hpcdist submit` submits: the plan's sbatch script on a
    Slurm site; on a local site, what the submission will do."""
    return _slurm_script(plan) if plan.slurm else _local_text(plan)


def render(spec: JobSpec, site: Site, origin: Origin, excluded: Exclusions | None = None) -> str:
    """(job spec, site) -> its script, as a pure function: ``script`` of the plan resolved
    without the disk (`excluded`: a reading of the site's health record)."""
    return script(resolve(spec, site, origin, excluded=excluded))


def _slurm_script(plan: Plan) -> str:
    """The sbatch script text of a plan on a Slurm site."""
    spec, site, origin, container = plan.base, plan.site, plan.origin, plan.container
    check_controls(spec.model_dump(mode="json"), "job")
    check_controls(site.model_dump(mode="json"), "site")
    check_controls(list(origin.overrides), "--set")  # only reached by a value no key holds
    for flag, _ in plan.directives:
        if not _FLAG.match(flag):
            raise RenderError(f"sbatch flag {flag!r} is not a valid option name (lowercase letters, digits, '-')")
    context = {
        "version": __version__,
        "site_name": site.name,
        "job_name": spec.name,
        "job_kind": spec.kind,
        "reproduce": Shell(origin.command()),
        "directives": [(Shell(f), v if v is not True else True) for f, v in plan.directives],
        "notes": [Shell(line) for line in plan.excluded.lines()],
        "modules": list(site.modules),
        "setup": [Shell(line) for line in site.setup],
        "env": sorted(plan.job_env.items()),
        "prelude": [Shell(line) for line in plan.prelude],
        "launch_time_var": Shell(LAUNCH_TIME_VAR),
        # Any job may run again on fewer nodes (hpcdist.login.node_failure_wait shrinks a pending one that resizes:
        # min_nodes, its kind, or hpcdist checkpoints found only then): Slurm keeps the submission's task
        # count in SLURM_NTASKS, which srun and mpirun read, so the script takes it from the run's nodes.
        "tasks_per_node": spec.resources.tasks_per_node,
        "launch": [Shell(line) for line in plan.launch_line.splitlines()],
        # the ranks run in an image without Slurm's commands: the batch step asks for them
        "container": container.runtime if container else "",
        "image": container.image if container else "",
        "container_prelude": [Shell(line) for line in plan.container_prelude],
        "requeue_asked": REQUEUE_ASKED,
        "runner": SUBMITIT_RUNNER,
        # after a requeue: hpcdist.runtime.node_failure decides, once per run, whether it may go on
        "python": Shell(plan.launch.host()),
        "restart_check": RESTART_CHECK,
        "folder": str(plan.folder),
    }
    import jinja2

    try:
        return _environment().get_template(TEMPLATE).render(**context)
    except jinja2.TemplateError as exc:
        raise RenderError(f"template {TEMPLATE}: {exc}") from exc


def _local_text(plan: Plan) -> str:
    """What a local-site submission will do (there is no script to show)."""
    spec, site = plan.base, plan.site
    # no script on this site: a folder with a newline (submitit allows one) is only a path here
    check_controls(spec.model_dump(mode="json", exclude={"folder"}), "job")
    lines = [
        f"# hpcdist {__version__}: site {site.name!r} runs jobs on this machine, without a scheduler",
        f"# Reproduce with: {plan.origin.command()}",
        f"# submitit's LocalExecutor starts {spec.resources.tasks_per_node} process(es), one per rank:",
        f"#   {plan.launch_line}",
        f"# environment: {' '.join(f'{k}={shlex.quote(v)}' for k, v in sorted(plan.env.items())) or '(none added)'}",
        *([f"# from your shell (values not shown): {' '.join(spec.env_passthrough)}"] if spec.env_passthrough else []),
        f"# time limit: {plan.time_min:g} min; collective timeout: {spec.timeout(site):g} s",
    ]
    return "\n".join(lines) + "\n"


def first_command_line(script: str) -> int:
    for i, line in enumerate(script.splitlines()):
        if line.strip() and not line.lstrip().startswith("#"):
            return i
    return -1


__all__: Sequence[str] = ("script", "render", "check_controls")
