"""The GPU check's jobs, as data (benchmarks/gpu_check.py): the scripts some rows submit, what
`hpcdist submit` printed about a job (`Submitted`, `Job`), and what the job wrote, read back.

The NCCL report script and `nccl_report`, which reads the line it prints, live together here.
Beside them: the run summary's failed line, the log lines torch's ProcessGroupNCCL prints, and a
train_gpt run's result tables and checkpoints (losses, resume steps, loss-scaler state, a digest
of the weights). The judges (benchmarks/gpu_judges.py) and the rows (benchmarks/gpu_rows.py,
gpu_train_rows.py) read through these, so each format is parsed in one place.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NCCL_REPORT = "gpu-check nccl report: "

# ------------------------------------------------------------------ the scripts some rows submit

NCCL_REPORT_SCRIPT = f'''"""gpu-check: what the default group hpcdist.init() made is, as torch and the rank see it."""
import json, os
import torch, torch.distributed as dist, hpcdist
ctx = hpcdist.init()
x = torch.full((4,), float(ctx.rank + 1), device=ctx.device)
dist.all_reduce(x)
group = dist.distributed_c10d._get_default_group()
backend = group._get_backend(x.device)
timeout = getattr(getattr(backend, "options", None), "_timeout", None)
report = {{
    "backend": dist.get_backend(), "backend_class": type(backend).__name__, "device": str(x.device),
    "pg_timeout_s": timeout.total_seconds() if timeout is not None else None,
    "async_error_handling_env": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    "sum": float(x[0]), "expected_sum": ctx.world_size * (ctx.world_size + 1) / 2,
    "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
}}
print({NCCL_REPORT!r} + json.dumps(report), flush=True)
ctx.close()
'''

ABORT_SCRIPT = '''"""gpu-check: an all_reduce queued behind a ~30 s kernel, which NCCL's watchdog times out."""
import torch, torch.distributed as dist, hpcdist
ctx = hpcdist.init()
x = torch.ones(4, device=ctx.device)
dist.all_reduce(x)
torch.cuda.synchronize()
torch.cuda._sleep(int(60e9))  # about 30 s of one SM's cycles
dist.all_reduce(x)
torch.cuda.synchronize()
ctx.close()
'''


# ------------------------------------------------------------------ what a job printed and wrote


@dataclass
class Submitted:
    """What `hpcdist submit` printed about the job it submitted."""

    job_id: str | None = None
    logs: list[Path] = field(default_factory=list)
    result: Path | None = None


def submitted(stdout: str) -> Submitted:
    """The job id, log files and result file from `hpcdist submit`'s first lines."""
    out = Submitted()
    lines = stdout.splitlines()
    for i, line in enumerate(lines):
        if out.job_id is None and (m := re.match(r"submitted job (\S+) ", line)):
            out.job_id = m.group(1)
        elif line.strip().startswith("logs:"):
            out.logs.append(Path(line.split("logs:", 1)[1].strip()))
            following = lines[i + 1] if i + 1 < len(lines) else ""
            if re.match(r"\s{4,}\S", following) and not re.match(r"\s*[a-z ]+: ", following):  # the err file
                out.logs.append(Path(following.strip()))
        elif line.strip().startswith("result:") and out.result is None:
            out.result = Path(line.split("result:", 1)[1].strip())
    return out


def failed_line(stdout: str, rank: int = 0) -> str:
    """The summary's line for `rank` when it failed (``rank 0: FAILED ...``), else ''."""
    return next((ln.strip() for ln in stdout.splitlines() if ln.strip().startswith(f"rank {rank}: FAILED")), "")


def why(code: int, out: str, err: str) -> str:
    """A failed command in one line: its exit code and its last line that names an error."""
    lines = [ln for ln in (err + out).splitlines() if "rror" in ln or "FAILED" in ln] or err.splitlines()
    return f"exit {code}: {(lines or ['(no output)'])[-1].strip()[:300]}"


@dataclass
class Job:
    """One `hpcdist submit --wait`: its exit code, what it printed, how long it took, the job's logs."""

    code: int
    out: str
    err: str
    took: float
    info: Submitted

    @property
    def result(self) -> Path | None:
        return self.info.result if self.info.result is not None and self.info.result.exists() else None

    @property
    def why(self) -> str:
        return why(self.code, self.out, self.err)

    def logs(self) -> str:
        """Every file of the job's log folder (each rank's output and error, hpcdist's rank logs)."""
        folders = {p.parent for p in self.info.logs}
        texts = []
        for folder in sorted(folders):
            for p in sorted(folder.glob("*")):
                if p.is_file() and p.suffix in (".out", ".err", ".log"):
                    texts.append(p.read_text(errors="replace"))
        return "\n".join(texts)


def step_losses(table: Mapping[str, Any]) -> dict[int, float]:
    """A ``train/steps`` table as {step: loss}."""
    return {int(s): float(v) for s, v in zip(table["step"], table["loss"], strict=True)}


def read_steps(result: Path) -> dict[int, float]:
    """{step: loss} of a train_gpt result file (every step the run has seen, a resumed run's too)."""
    import h5py

    from hpcdist.store.results import read_table

    with h5py.File(result, "r") as f:
        return step_losses(read_table(f["train/steps"]))


def window_rates(result: Path, window: int) -> dict[int, float]:
    """{last step: tokens/s} of a train_gpt run's windows of `window` steps (its ``log_every``: the
    rows of a window share its time), the first one (warm-up, compilation) left out."""
    import h5py

    from hpcdist.store.results import read_table

    with h5py.File(result, "r") as f:
        t = read_table(f["train/steps"])
    rates = {int(s): float(v) for s, v in zip(t["step"], t["tokens_per_s"], strict=True) if int(s) % window == 0}
    return dict(list(rates.items())[1:])


def window_rate(result: Path, window: int) -> float:
    """The median of `window_rates`; nan with none."""
    import statistics

    rates = list(window_rates(result, window).values())
    return statistics.median(rates) if rates else float("nan")


def after_save(result: Path, window: int, saved_at: int) -> str:
    """The median window after a checkpoint saved in the background at step `saved_at` against
    those before it, as the row's words (the save's write, hash and commit overlap the next steps)."""
    import statistics

    rates = window_rates(result, window)
    before = [v for s, v in rates.items() if s <= saved_at]
    after = [v for s, v in rates.items() if s > saved_at]
    if not before or not after:
        return f"no windows on both sides of the step-{saved_at} save"
    ratio = statistics.median(after) / statistics.median(before)
    return f"windows after the step-{saved_at} background save {ratio:.2f}x those before"


def resume_steps(result: Path) -> list[int]:
    """The steps at which a train_gpt run read a checkpoint (its ``train/checkpoints`` rows of op read)."""
    import h5py

    from hpcdist.store.results import read_table

    with h5py.File(result, "r") as f:
        t = read_table(f["train/checkpoints"])
    return [int(s) for s, op in zip(t.get("step", []), t.get("op", []), strict=True) if str(op) == "read"]


def checkpoints_of(folder: Path) -> dict[int, Path]:
    """{step: file} of the ``step_*.h5`` checkpoints under `folder`."""
    out = {}
    for p in folder.rglob("step_*.h5"):
        if m := re.fullmatch(r"step_(\d+)\.h5", p.name):
            out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def scaler_state(checkpoint: Path) -> dict[str, Any]:
    """The loss scaler's state a train_gpt checkpoint holds (``/scaler``), {} when it was disabled."""
    from hpcdist.store import read

    tree = read(checkpoint, groups=("scaler",)).tree
    return dict(json.loads(tree["scaler"]["state_json"]))


def model_digest(checkpoint: Path) -> str:
    """sha256 over the checkpoint's ``/model`` datasets, by name: two equal digests, the same weights to the bit."""
    import h5py

    h = hashlib.sha256()
    with h5py.File(checkpoint, "r") as f:
        names: list[str] = []
        f["model"].visit(lambda n: names.append(n) if isinstance(f["model"][n], h5py.Dataset) else None)
        for name in sorted(names):
            h.update(name.encode() + b"\0" + f["model"][name][()].tobytes())
    return h.hexdigest()


def largest_tensor_bytes(checkpoint: Path) -> int:
    """The biggest tensor of a train_gpt checkpoint, in the dtype it is stored in: the bucket
    ``infer_gpt``'s ``load: broadcast`` sends it in when it is bigger than ``bucket_mb``."""
    import torch

    from hpcdist.model.checkpoint import read_header

    header = read_header(checkpoint)
    return max(math.prod(shape) * getattr(torch, header.dtypes[name]).itemsize
               for name, shape in header.shapes.items())


def first_step_s(log: str) -> float | None:
    """How long a train_gpt run's first step took, from its rank log (``step N took X s: ...``):
    with compiling, mostly compile time, or loading the compiled code from the cache."""
    m = re.search(r"step \d+ took ([0-9.]+) s", log)
    return float(m.group(1)) if m else None


def torch_nccl_settings(log: str) -> dict[str, int]:
    """What torch's ProcessGroupNCCL logged about itself when made (with ``TORCH_CPP_LOG_LEVEL=INFO``):
    the first group's ``TIMEOUT(ms)`` and the ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` mode it uses."""
    out = {}
    if m := re.search(r"ProcessGroupNCCL initialization options: .*?TIMEOUT\(ms\): (\d+)", log):
        out["timeout_ms"] = int(m.group(1))
    if m := re.search(r"ProcessGroupNCCL environments: .*?TORCH_NCCL_ASYNC_ERROR_HANDLING: (\d+)", log):
        out["error_handling"] = int(m.group(1))
    return out


def nccl_report(log: str) -> dict[str, Any] | None:
    """The report line the NCCL group's script printed (``NCCL_REPORT_SCRIPT``), or None."""
    for line in log.splitlines():
        if NCCL_REPORT in line:
            return dict(json.loads(line.split(NCCL_REPORT, 1)[1]))
    return None
