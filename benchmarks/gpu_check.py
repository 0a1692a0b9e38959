"""Every GPU path of hpcdist, started as a user starts it, on a machine with GPUs and no network (< 10 min).

    make gpu-check            # or: python benchmarks/gpu_check.py [--out DIR] [--quick] [--only WORDS]...

Each row starts its job through the front door on the ``local`` site: ``hpcdist submit --site local
--set resources.gpus_per_node=N --set resources.tasks_per_node=N ... --wait`` (the command line, run
as ``python -m hpcdist.cli``), or ``hpcdist.Executor(site="local", gpus_per_node=1)``. The local
site gives each task the machine's first N GPUs (``gpus_per_node: auto``), so no row sets the
site's GPU count. One row starts ranks through the bootstrap alone, to fake a binding the local
site never makes, and says "(bootstrap only)" in its name; the generation row runs in this process.

Each row's verdict is a pure function of what its job wrote (result attributes and tables,
checkpoints, log lines): the ``judge_*`` functions of benchmarks/gpu_judges.py (on training,
benchmarks/gpu_train_judges.py), tested on CPU with one passing input and one for each way the
subject can break (tests/test_gpu_check.py); the rows that start the jobs are
benchmarks/gpu_rows.py (the training rows benchmarks/gpu_train_rows.py), and the jobs' scripts and
the readers of what they wrote benchmarks/gpu_jobs.py. The rows, and what fails them:

- ``hpcdist env``: not the GPUs torch counts;
- NCCL group (backend auto): a script through ``submit`` reports the default group's backend and
  class, its timeout, and torch's own log line of the error handling its ProcessGroupNCCL uses
  (``TORCH_CPP_LOG_LEVEL=INFO``; the check sets no ``TORCH_NCCL_*``): fails unless NCCL, the
  spec's timeout, a mode that ends a rank whose collective timed out (1 or 3), a right sum;
- watchdog abort: an all_reduce behind a 30 s kernel, ``timeout_s: 5``: fails unless the job
  fails with hpcdist's summary (``did not complete within 5 s; NCCL's watchdog ends this rank``)
  and ends within ``timeout_s + hpcdist.runtime.abort.GRACE_S + 30`` s of its submit;
- ``bench_collectives`` (and ``bench_p2p`` with two GPUs, MPI with CUDA buffers where the MPI is
  CUDA-aware): no rows, wrong elements, or no bandwidth;
- GPT-2 small (124M) trained by ``train_gpt``, bf16 and fp16: not the precision asked, a loss
  that is not finite or does not fall, and for fp16 a loss scaler that never stepped (its state in
  the final checkpoint: disabled, growth tracker 0, or more than half the steps skipped);
- train_gpt / plain compiled loop: the bf16 run's tokens/s (median of its ``log_every`` windows, the
  first left out; 120 steps; it saves only after its last window, as the reference saves nothing) against
  benchmarks/train_vs_plain.py's plain loop (the same model written plainly, the same batch,
  ``torch.compile``, fused AdamW, TF32), submitted as a script in the same check:
  fails below 1.0x, or when either side is not compiled bf16 on the GPU; MFU (6N + 6LTD per token,
  the GPU's bf16 peak: 989 TFLOP/s for H100 SXM and H200) is reported beside it, 40 % the goal;
- checkpoint save, then resume: the fp16 run again, stopped half way (``params.run_steps``) and
  resubmitted: the checkpoint must verify, the second job must read it at the half-way step, and
  every step's loss must equal the uninterrupted run's within ``RESUME_ATOL + RESUME_RTOL x |loss|``
  (not bit for bit: those runs use non-deterministic kernels), with the same loss-scaler state;
- the same with ``params.deterministic=true`` (bf16): every step's loss and the final weights
  bit for bit;
- ``examples/ddp_gpu.py`` (a torchrun-style script, no hpcdist import) through ``submit``
  unchanged: not completed, a rank not on ``cuda:LOCAL_RANK`` under NCCL, no CUDA memory used,
  or a loss that does not fall;
- two ranks on one GPU (bootstrap only): not hpcdist's one-line refusal on both ranks;
- CUDA tensors to ``ctx.results`` (``hpcdist.Executor``): the values not in the result file;
- ``infer_gpt`` in bfloat16: not 2 bytes a weight, or a load that did not stream (its device peak
  above the model and two buckets, a bucket 64 MiB or the checkpoint's largest tensor);
- checkpoint staging (``benchmarks/gpu_ckpt_staging.py`` through ``submit``): a copy not pinned,
  not reused, not bit for bit, or slower than a pageable ``.cpu()``;
- generation against ``transformers`` (in process): greedy tokens that differ.

It prints one table (rich) and writes it to ``gpu_check.json`` and ``gpu_check.txt`` in --out;
the exit code is 1 when a row failed. Without a GPU it says "no GPU" in one line and exits 2.

The GPU machines have torch, h5py, mpi4py, transformers, rich and matplotlib but not submitit or
pydantic (nor their dependencies). The check installs what is missing from wheels in ``.whl/``
beside the repository root (ignored by git); make them on a machine with network, for the GPU
machine's Python (here 3.12; change --python-version to match):

    pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \\
        --platform manylinux_2_17_x86_64 -d .whl \\
        'submitit>=1.5,<2' cloudpickle 'pydantic>=2.5,<3' pydantic-core annotated-types \\
        typing-inspection typing-extensions pyyaml jinja2 markupsafe xxhash
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
# Run as `python benchmarks/gpu_check.py`, only benchmarks/ is on the path: the root too, for the
# check's own modules below and for hpcdist (not installed on the GPU machines).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_judges import Row  # noqa: E402
from benchmarks.gpu_rows import Checker  # noqa: E402

if TYPE_CHECKING:
    import hpcdist

WHEELS = ROOT / ".whl"
# import name -> distribution name, for what hpcdist needs beyond the GPU machine's packages
NEEDED = {"submitit": "submitit", "cloudpickle": "cloudpickle", "pydantic": "pydantic", "yaml": "pyyaml",
          "jinja2": "jinja2", "xxhash": "xxhash"}
NO_GPU_EXIT = 2


# ------------------------------------------------------------------ parts that run anywhere


def missing_modules(names: Sequence[str], find: Callable[[str], Any] = importlib.util.find_spec) -> list[str]:
    """The import names of `names` that this Python cannot import."""
    return [n for n in names if find(n) is None]


def install_missing(
    missing: Sequence[str], wheels: Path = WHEELS, run: Callable[..., Any] = subprocess.run
) -> Row:
    """Install the distributions behind `missing` from `wheels` (no index); the row says what happened."""
    if not missing:
        return Row("python packages", "ok", "", "all present")
    dists = [NEEDED.get(m, m) for m in missing]
    have = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not have:
        return Row(
            "python packages", "fail", "",
            f"lacks {', '.join(dists)} and {wheels} holds no wheels; make them with the pip download "
            f"command in benchmarks/gpu_check.py's docstring on a machine with network",
        )
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels), *dists]
    proc = run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["(no output)"]
        return Row("python packages", "fail", "", f"pip could not install {', '.join(dists)} from {wheels}: {last[0]}")
    return Row("python packages", "ok", "", f"installed {', '.join(dists)} from {wheels}")


def write_table(rows: Sequence[Row], out: Path, facts: dict[str, Any]) -> str:
    """Print the table and write it as JSON and text into `out`; returns the text."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hpcdist gpu-check: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    for col in ("check", "status", "figure", "detail"):
        table.add_column(col, overflow="fold")
    for r in rows:
        style = {"ok": "green", "skip": "yellow"}.get(r.status, "red")
        table.add_row(r.check, f"[{style}]{r.status}[/]", r.figure, r.detail)
    console = Console(record=True, width=160)
    console.print(table)
    text = console.export_text()
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.txt").write_text(text)
    (out / "gpu_check.json").write_text(json.dumps({"facts": facts, "rows": [asdict(r) for r in rows]}, indent=1))
    return text


def has_gpu() -> tuple[bool, str]:
    """Whether torch sees a CUDA GPU, and what it is (or why not)."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch cannot be imported ({exc})"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is false)"
    return True, torch.cuda.get_device_name(0)


def _cuda_results_job(ctx: hpcdist.Context) -> dict[str, Any]:
    """Run by hpcdist.Executor on a rank: CUDA tensors (one with grad) into ctx.results.

    Here, in the script run as ``__main__``, so that the Executor ships it by value as it ships a
    user's script's function; from an importable module it would go by reference, with a snapshot."""
    import torch

    x = torch.ones(4, device=ctx.device, requires_grad=True)
    ctx.results.attrs["loss"] = (x * 0.5).sum()
    ctx.results.attrs["device"] = str(ctx.device)
    ctx.results.table("steps", {"loss": [x.sum(), x.sum() * 2], "n": torch.arange(2, device=ctx.device)})
    return {"device": str(ctx.device), "result": str(ctx.results.path)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "hpcdist-out" / "gpu-check")
    ap.add_argument("--quick", action="store_true", help="fewer steps and smaller sizes")
    ap.add_argument("--only", action="append", default=[], metavar="WORDS",
                    help="run only the rows whose name contains WORDS (repeatable), to rerun a failed row; "
                         "--only 'train GPT-2' --only infer_gpt: the inference row reads the fp16 run's checkpoint")
    args = ap.parse_args(argv)
    ok, what = has_gpu()
    if not ok:
        print(f"gpu-check: no GPU: {what}")
        return NO_GPU_EXIT
    t0 = time.time()
    packages = install_missing(missing_modules(list(NEEDED)))
    import torch

    facts: dict[str, Any] = {"gpu": what, "torch": torch.__version__, "cuda": torch.version.cuda,
                             "python": sys.version.split()[0]}
    with tempfile.TemporaryDirectory(prefix="hpcdist-gpu-check-") as tmp:
        c = Checker(Path(tmp), args.quick)
        if args.only:
            c.only = [w.lower() for w in args.only]
        c.add(packages)
        if packages.status == "ok":
            c.guarded("hpcdist env", c.env_discovery)
            c.guarded("NCCL group (backend auto)", c.nccl_group)
            c.guarded("watchdog abort: hpcdist's summary, the job ends", c.nccl_abort)
            c.guarded("bench", c.bench)
            c.guarded("train GPT-2 small", c.training.train)
            c.guarded("train_gpt / plain compiled loop (GPT-2 small, bf16), MFU", c.training.speed)
            c.guarded("resume = uninterrupted, bit for bit (params.deterministic)", c.training.determinism)
            c.guarded("torchrun-style DDP script (examples/ddp_gpu.py)", c.ddp_example)
            c.guarded("two ranks on one GPU refused (bootstrap only)", c.duplicate_gpu)
            c.guarded("CUDA tensors to ctx.results (hpcdist.Executor)", partial(c.cuda_results, _cuda_results_job))
            c.guarded("infer_gpt bfloat16 memory", c.infer_bf16)
            c.guarded("checkpoint staging of CUDA state (gpu_ckpt_staging.py)", c.staging)
        c.guarded("generation vs transformers (in process)", c.generation)
        facts["seconds"] = round(time.time() - t0)
        write_table(c.rows, args.out, facts)
    print(f"written: {args.out / 'gpu_check.json'} and gpu_check.txt")
    return 0 if all(r.status != "fail" for r in c.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
