"""Every GPU path of hpcdist, on a machine with one GPU and no network, in one command (< 10 min).

    make gpu-check            # or: python benchmarks/gpu_check.py [--out DIR] [--quick]

Checks, each one row of the table (status ok / skip / fail, the figure, what was seen):

1. ``hpcdist env`` (``python -m hpcdist.cli env``) finds the GPU;
2. a one-rank NCCL group formed by hpcdist's bootstrap (``python -m hpcdist.runtime.entry``
   running the smoke job), with the group timeout and TORCH_NCCL_ASYNC_ERROR_HANDLING set
   (read back from the result file);
3. ``bench_collectives`` on the NCCL path (one rank: algbw, #wrong); ``bench_p2p`` needs two
   ranks and NCCL refuses two ranks on one GPU, so it is skipped with that reason; MPI with CUDA
   buffers (``mpi_buffers: cuda``) where the MPI is CUDA-aware, skipped with the reason otherwise;
4. GPT-2 small (124M: 12 layers, 12 heads, d_model 768, context 1024, vocab 50257) trained by the
   ``train_gpt`` job with bf16 autocast and with fp16 plus the loss scaler: tokens/s and MFU
   against the GPU's dense bf16/fp16 peak;
5. checkpoint save and resume of CUDA state: the fp16 run stops half way (``run_steps``), writes
   its checkpoint, and a second run resumes from it (model, AdamW and loss-scaler state);
6. generation (``benchmarks/infer_vs_hf.py``'s ``compare``) on the GPU against ``transformers``
   ``generate``: tokens/s, latency per batch, ratio, identical greedy tokens.

It prints one table (rich) and writes it to ``gpu_check.json`` and ``gpu_check.txt`` in --out.
Without a GPU it says "no GPU" in one line and exits 2.

The GPU machines have torch, h5py, mpi4py, transformers, rich and matplotlib but not submitit or
pydantic (nor their dependencies). The check installs what is missing from wheels in ``.whl/``
beside the repository root (ignored by git); make them on a machine with network, for the GPU
machine's Python (here 3.11; change --python-version to match):

    pip download --only-binary=:all: --python-version 3.11 --platform manylinux2014_x86_64 \\
        --platform manylinux_2_17_x86_64 -d .whl \\
        'submitit>=1.5,<2' cloudpickle 'pydantic>=2.5,<3' pydantic-core annotated-types \\
        typing-inspection typing-extensions pyyaml jinja2 markupsafe
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
# import name -> distribution name, for what hpcdist needs beyond the GPU machine's packages
NEEDED = {"submitit": "submitit", "cloudpickle": "cloudpickle", "pydantic": "pydantic", "yaml": "pyyaml",
          "jinja2": "jinja2"}
GPT2_SMALL: dict[str, Any] = {"n_layer": 12, "n_head": 12, "d_model": 768, "context": 1024, "vocab_size": 50257}
NO_GPU_EXIT = 2


@dataclass
class Row:
    """One line of the table."""

    check: str
    status: str  # ok, skip, fail
    figure: str = ""
    detail: str = ""


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


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s (flops per token x tokens/s) over the peak (TFLOP/s)."""
    if peak is None or not tokens_per_s > 0:
        return None
    return flops_per_token * tokens_per_s / (peak * 1e12)


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


# ------------------------------------------------------------------ the GPU checks


class Checker:
    """Runs hpcdist's own entry points on the `local` site, storage under `work`."""

    def __init__(self, work: Path, quick: bool) -> None:
        import torch

        self.work = work
        self.quick = quick
        self.gpus = torch.cuda.device_count()
        self.rows: list[Row] = []
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def storage(self, name: str) -> list[str]:
        out = []
        for key in ("results", "checkpoints", "scratch", "logs"):
            out += ["--set", f"site.storage.{key}={self.work / name / key}"]
        return out

    def hpcdist(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def entry(self, name: str, spec: str, *sets: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess[str],
                                                                                    Path | None]:
        """One rank of `spec` on the local site with one GPU; returns the process and its result file."""
        gpu = ["site.partitions.local.gpus_per_node=1", "resources.nodes=1", "resources.tasks_per_node=1",
               "resources.gpus_per_node=1"]
        args = ["-m", "hpcdist.runtime.entry", spec, "--site", "local", *self.storage(name)]
        for s in (*gpu, *sets):
            args += ["--set", s]
        proc = self.hpcdist(*args, timeout=timeout)
        found = sorted((self.work / name / "results").rglob("*.h5"), key=lambda p: p.stat().st_mtime)
        return proc, (found[-1] if found else None)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(f"  {row.check}: {row.status} {row.figure} {row.detail}", flush=True)

    def guarded(self, check: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # a failed check is a row, the others still run
            self.add(Row(check, "fail", "", f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"))

    @staticmethod
    def why(proc: subprocess.CompletedProcess[str]) -> str:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if "rror" in ln] or proc.stderr.splitlines()
        return f"exit {proc.returncode}: {(lines or ['(no output)'])[-1][:300]}"

    # -- 1
    def env_discovery(self) -> None:
        proc = self.hpcdist("-m", "hpcdist.cli", "env", timeout=120)
        gpus = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip().startswith("gpu ")]
        ok = proc.returncode == 0 and bool(gpus)
        self.add(Row("hpcdist env", "ok" if ok else "fail", f"{len(gpus)} GPU(s)",
                     "; ".join(gpus) if ok else self.why(proc)))

    # -- 2
    def nccl_group(self) -> None:
        from hpcdist.store.results import read_attrs

        proc, path = self.entry("smoke", "jobs/smoke.yaml", "backend=nccl", "timeout_s=60",
                                "env={TORCH_NCCL_ASYNC_ERROR_HANDLING: '1'}", timeout=180)
        if proc.returncode != 0 or path is None:
            self.add(Row("NCCL group (1 rank)", "fail", "", self.why(proc)))
            return
        attrs = read_attrs(path)
        import h5py

        with h5py.File(path) as f:
            env = {k: str(v) for k, v in f["env"].attrs.items()} if "env" in f else {}
        aeh = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "unset")
        ready = [ln for ln in proc.stderr.splitlines() if "group ready" in ln]
        backend = "nccl" if ready and "backend nccl" in ready[-1] else "not nccl"
        ok = backend == "nccl" and aeh == "1" and attrs.get("sum") == attrs.get("expected_sum")
        self.add(Row("NCCL group (1 rank)", "ok" if ok else "fail", f"backend {backend}",
                     f"timeout {attrs['spec'].get('timeout_s')} s, TORCH_NCCL_ASYNC_ERROR_HANDLING={aeh}, "
                     f"all_reduce sum {attrs.get('sum')} (expected {attrs.get('expected_sum')})"))

    # -- 2b
    def nccl_abort(self) -> None:
        """An all_reduce queued behind a 30 s kernel, timeout 5 s: NCCL's watchdog aborts the rank
        (no exception in Python); the summary still has hpcdist's error, written before the abort."""
        check = "watchdog abort keeps hpcdist's summary"
        script = self.work / "nccl_abort.py"
        script.write_text(
            "import torch, torch.distributed as dist, hpcdist\nctx = hpcdist.init()\n"
            "x = torch.ones(4, device=ctx.device)\ndist.all_reduce(x)\ntorch.cuda.synchronize()\n"
            "torch.cuda._sleep(int(60e9))  # about 30 s of one SM's cycles\ndist.all_reduce(x)\n"
            "torch.cuda.synchronize()\nctx.close()\n")
        t = time.time()
        proc = self.hpcdist("-m", "hpcdist.cli", "submit", "--site", "local", "--wait", "--wait-timeout", "240",
                            *self.storage("abort"), "--set", "site.partitions.local.gpus_per_node=1",
                            "--set", "resources.gpus_per_node=1", "--set", "backend=nccl", "--set", "timeout_s=5",
                            "--", str(script), timeout=300)
        took = time.time() - t
        line = next((ln.strip() for ln in proc.stdout.splitlines() if ln.strip().startswith("rank 0: FAILED")), "")
        dumps = sorted((self.work / "abort" / "logs").rglob("flight_recorder_rank*"))
        ok = proc.returncode == 1 and "did not complete within 5 s; NCCL's watchdog ends this rank" in line
        self.add(Row(check, "ok" if ok else "fail", f"{took:.0f} s",
                     f"{line[:300]}; flight recorder dump: {[p.name for p in dumps]}" if line else self.why(proc)))

    # -- 3
    def bench(self) -> None:
        sizes = ["params.max_bytes=16M"] if self.quick else ["params.max_bytes=256M"]
        common = ["resources.time_min=10", "params.enforce_minimums=false", "params.check=true",
                  "params.ops=[all_reduce, all_gather, reduce_scatter, broadcast]", *sizes]
        proc, path = self.entry("nccl", "jobs/bench_collectives.yaml", "backend=nccl", "params.paths=[torch]",
                                *common, timeout=300)
        self.add(self._bench_row("bench_collectives torch/nccl", proc, path))
        if self.gpus < 2:
            self.add(Row("bench_p2p torch/nccl (pingpong, unidir, bidir)", "skip", "",
                         "not run: needs 2 GPUs (NCCL refuses two ranks on one GPU); bidir's order under NCCL is "
                         "checked on CPU by tests/test_bench_p2p_order.py"))
        else:
            proc, path = self.entry("p2p", "jobs/bench_p2p.yaml", "backend=nccl", "resources.tasks_per_node=2",
                                    "resources.gpus_per_node=2", "site.partitions.local.gpus_per_node=2",
                                    "params.paths=[torch]", "params.enforce_minimums=false", timeout=300)
            self.add(self._bench_row("bench_p2p torch/nccl (pingpong, unidir, bidir)", proc, path))
        try:
            from mpi4py import MPI
        except ImportError as exc:
            self.add(Row("bench_collectives mpi/cuda", "skip", "", f"mpi4py cannot be imported: {exc}"))
            return
        query = getattr(MPI, "Query_cuda_support", None)
        if query is None or not query():
            self.add(Row("bench_collectives mpi/cuda", "skip", "",
                         f"this MPI ({MPI.Get_library_version().splitlines()[0][:60]}) is not CUDA-aware "
                         f"(MPI.Query_cuda_support() is {query() if query else 'absent'})"))
            return
        proc, path = self.entry("mpicuda", "jobs/bench_collectives.yaml", "backend=nccl", "params.paths=[mpi]",
                                "params.mpi_buffers=cuda", *common, timeout=300)
        self.add(self._bench_row("bench_collectives mpi/cuda", proc, path))

    def _bench_row(self, check: str, proc: subprocess.CompletedProcess[str], path: Path | None) -> Row:
        if proc.returncode != 0 or path is None:
            return Row(check, "fail", "", self.why(proc))
        import h5py

        best, wrong, rows = 0.0, 0, 0
        with h5py.File(path) as f:
            def visit(_: str, obj: Any) -> None:
                nonlocal best, wrong, rows
                if isinstance(obj, h5py.Group) and "algbw_gbps" in obj:
                    best = max(best, float(max(obj["algbw_gbps"][()], default=0.0)))
                    wrong += int(obj["wrong"][()].sum())
                    rows += len(obj["algbw_gbps"])

            f.visititems(visit)
        return Row(check, "ok" if rows and wrong == 0 else "fail", f"{best:.1f} GB/s algbw max",
                   f"{rows} rows, {wrong} wrong elements, {path.name}")

    # -- 4, 5
    def train(self, name: str) -> None:
        tokens = self.work / "tokens.h5"
        if not tokens.exists():
            texts = [str(p) for p in (ROOT / "README.md", *sorted((ROOT / "hpcdist").rglob("*.py")))]
            proc = self.hpcdist("-m", "hpcdist.cli", "data", "prepare", *texts, "-o", str(tokens), timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"hpcdist data prepare failed: {self.why(proc)}")
        steps = 20 if self.quick else 60
        model = "params.model={" + ", ".join(f"{k}: {v}" for k, v in GPT2_SMALL.items()) + "}"
        common = ["backend=nccl", f"params.data={tokens}", model, f"params.steps={steps}",
                  "params.batch.micro=16", "params.batch.accum=1", "params.optim.warmup_steps=5",
                  "params.eval.every=0", "params.eval.batches=1", f"params.checkpoint.every={steps // 2}",
                  "params.log_every=10", "timeout_s=300"]
        proc, path = self.entry(f"{name}-bf16", "jobs/train_gpt.yaml", *common, "params.precision=bf16", timeout=420)
        self.add(self._train_row("train GPT-2 small bf16", proc, path, "bf16"))
        # fp16 with the loss scaler, in two runs: the first stops half way with a checkpoint of
        # its CUDA state (model, AdamW, scaler), the second resumes from it and finishes.
        run = f"{name}-fp16"
        fp16 = [*common, "params.precision=fp16"]
        proc, _ = self.entry(run, "jobs/train_gpt.yaml", *fp16, f"params.run_steps={steps // 2}", timeout=420)
        ckpts = sorted((self.work / run / "checkpoints").rglob("*.h5"))
        saved = proc.returncode == 0 and bool(ckpts)
        self.add(Row("checkpoint save (CUDA state)", "ok" if saved else "fail",
                     f"{sum(p.stat().st_size for p in ckpts) / 1e6:.0f} MB",
                     f"{[p.name for p in ckpts]} after run_steps={steps // 2}" if saved else self.why(proc)))
        proc, path = self.entry(run, "jobs/train_gpt.yaml", *fp16, timeout=420)
        logs = "".join(p.read_text(errors="replace") for p in (self.work / run / "logs").rglob("*.log"))
        resumed = proc.returncode == 0 and "resumed from" in logs + proc.stderr
        self.add(Row("checkpoint resume (CUDA state)", "ok" if resumed else "fail", "",
                     "the second run resumed from the first run's checkpoint and finished" if resumed
                     else f"no 'resumed from' in the second run's logs; {self.why(proc)}"))
        self.add(self._train_row("train GPT-2 small fp16 + loss scaler", proc, path, "fp16"))

    def _train_row(self, check: str, proc: subprocess.CompletedProcess[str], path: Path | None, precision: str) -> Row:
        from hpcdist.store.results import read_attrs

        if proc.returncode != 0 or path is None:
            return Row(check, "fail", "", self.why(proc))
        a = read_attrs(path)
        import torch

        from hpcdist.train.metrics import peak_tflops

        peak = peak_tflops(torch.cuda.get_device_name(0), precision)
        tok_s = float(a.get("tokens_per_s_median", float("nan")))
        util = mfu(float(a["flops_per_token"]), tok_s, peak)
        mfu_s = f"{util:.1%}" if util is not None else "peak unknown"
        return Row(check, "ok" if a.get("precision") == precision else "fail",
                   f"{tok_s:,.0f} tokens/s, MFU {mfu_s}",
                   f"loss {a.get('final_loss', float('nan')):.3f}, {a.get('num_params', 0) / 1e6:.0f}M params, "
                   f"peak {peak} TFLOP/s, precision {a.get('precision')}")

    # -- 7: GPU-only paths of issue 35
    def duplicate_gpu(self) -> None:
        """Two ranks given one GPU: hpcdist's one-line refusal at check-in, not NCCL's "Duplicate GPU".

        The ranks are started as the local launcher starts them, but both with CUDA_VISIBLE_DEVICES=0
        (what a site whose binding gives two tasks one GPU does); the local site itself would hide the
        GPU from a job that asks for none."""
        args = [sys.executable, "-m", "hpcdist.runtime.entry", "jobs/smoke.yaml", "--site", "local",
                *self.storage("dup"), "--set", "resources.tasks_per_node=2", "--set", "timeout_s=60"]
        job = f"dup{os.getpid()}"
        t = time.time()
        procs = [subprocess.Popen(args, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={
            **self.env, "CUDA_VISIBLE_DEVICES": "0", "SUBMITIT_LOCAL_JOB_ID": job, "SUBMITIT_LOCAL_GLOBALID": str(r),
            "SUBMITIT_LOCAL_LOCALID": str(r), "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_NODEID": "0",
            "SUBMITIT_LOCAL_JOB_NUM_NODES": "1"}) for r in range(2)]
        outs = [p.communicate(timeout=180)[0] for p in procs]
        logs = "\n".join(outs)
        ours = [ln.strip() for ln in logs.splitlines() if "were given one GPU" in ln]
        ok = all(p.returncode != 0 for p in procs) and len(ours) >= 2 and "Duplicate GPU detected" not in logs
        detail = ours[0][-240:] if ours else f"exit {[p.returncode for p in procs]}: {logs.strip()[-300:]}"
        self.add(Row("two ranks on one GPU refused", "ok" if ok else "fail", f"{time.time() - t:.0f} s", detail))

    def cuda_results(self) -> None:
        """A script's CUDA tensors given to ctx.results reach the result file as numbers."""
        script = self.work / "cuda_results.py"
        script.write_text(
            "import torch, hpcdist\nctx = hpcdist.init()\nx = torch.ones(4, device=ctx.device, requires_grad=True)\n"
            "ctx.results.attrs['loss'] = (x * 0.5).sum()\nctx.results.attrs['device'] = str(ctx.device)\n"
            "ctx.results.table('steps', {'loss': [x.sum(), x.sum() * 2], 'n': torch.arange(2, device=ctx.device)})\n"
            "ctx.close()\n")
        env = {k: v for k, v in self.env.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))}
        proc = subprocess.run([sys.executable, str(script)], cwd=self.work, env=env, capture_output=True, text=True,
                              timeout=180)
        found = sorted((self.work / "hpcdist-out" / "results" / "cuda_results").glob("*.h5"))
        if proc.returncode != 0 or not found:
            self.add(Row("CUDA tensors to ctx.results", "fail", "", self.why(proc)))
            return
        from hpcdist.store.results import read_attrs

        a = read_attrs(found[-1])
        ok = a.get("loss") == 2.0 and str(a.get("device", "")).startswith("cuda")
        self.add(Row("CUDA tensors to ctx.results", "ok" if ok else "fail", f"loss {a.get('loss')}",
                     f"on {a.get('device')}, written to {found[-1].name}"))

    def infer_bf16(self) -> None:
        """infer_gpt in bfloat16 from the fp16 run's checkpoint: weights and KV cache in 2 bytes a value."""
        ckpts = sorted((self.work / "gpt2-fp16" / "checkpoints").rglob("*.h5"))
        if not ckpts:
            self.add(Row("infer_gpt bfloat16 memory", "skip", "", "no checkpoint: the training check wrote none"))
            return
        prompts = self.work / "prompts.txt"
        prompts.write_text("\n".join(f"The cluster node {i} reports" for i in range(8)) + "\n")
        proc, path = self.entry("infer", "jobs/infer_gpt.yaml", "backend=nccl", f"params.checkpoint={ckpts[-1]}",
                                f"params.prompts={prompts}", "params.tp=1", "params.dtype=bfloat16",
                                "params.max_new_tokens=64", "params.end_token=null", timeout=300)
        if proc.returncode != 0 or path is None:
            self.add(Row("infer_gpt bfloat16 memory", "fail", "", self.why(proc)))
            return
        import h5py

        from hpcdist.store.results import read_table

        with h5py.File(path) as f:
            dtype = f.attrs["dtype"]
            ranks = read_table(f["ranks"])
            n = json.loads(f.attrs["model_config_json"])
        from hpcdist.model.config import GPTConfig

        cfg = GPTConfig(**n)
        params = cfg.num_params()
        w, kv, peak = (int(ranks[k][0]) for k in ("weight_bytes", "kv_cache_peak_bytes", "device_peak_bytes"))
        want = 2 * (params + cfg.vocab_size * cfg.d_model)  # + the head's rows once more, transposed
        ok = dtype == "bfloat16" and abs(w - want) < 0.01 * want
        self.add(Row("infer_gpt bfloat16 memory", "ok" if ok else "fail",
                     f"weights {w / 1e6:.0f} MB, KV {kv / 1e6:.0f} MB, device peak {peak / 1e6:.0f} MB",
                     f"dtype {dtype}; ({params / 1e6:.0f}M params + the head's transposed copy) x 2 bytes = "
                     f"{want / 1e6:.0f} MB; float32 would hold twice"))

    def determinism(self) -> None:
        """params.deterministic: two runs of the same steps give the same losses, bit for bit."""
        tokens = self.work / "tokens.h5"
        model = "params.model={" + ", ".join(f"{k}: {v}" for k, v in GPT2_SMALL.items()) + "}"
        losses = []
        t = time.time()
        for i in range(2):
            proc, path = self.entry(f"det{i}", "jobs/train_gpt.yaml", "backend=nccl", f"params.data={tokens}", model,
                                    "params.steps=8", "params.batch.micro=8", "params.batch.accum=1",
                                    "params.optim.warmup_steps=2", "params.eval.every=0", "params.eval.batches=1",
                                    "params.checkpoint.every=1000", "params.log_every=1", "params.precision=bf16",
                                    "params.deterministic=true", "timeout_s=300", timeout=420)
            if proc.returncode != 0 or path is None:
                self.add(Row("deterministic training (params.deterministic)", "fail", "", self.why(proc)))
                return
            import h5py

            from hpcdist.store.results import read_table

            with h5py.File(path) as f:
                losses.append([float(v) for v in read_table(f["train/steps"])["loss"]])
        same = losses[0] == losses[1] and len(losses[0]) > 0
        self.add(Row("deterministic training (params.deterministic)", "ok" if same else "fail",
                      f"{len(losses[0])} steps, {time.time() - t:.0f} s",
                      f"losses identical to the bit: {same} (last {losses[0][-1]!r} vs {losses[1][-1]!r})"))

    # -- 6
    def generation(self) -> None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from infer_vs_hf import compare

        from hpcdist.model.config import GPTConfig

        cfg = GPTConfig(**{**GPT2_SMALL, "context": 1024})
        import torch

        # timed in float32; greedy equality judged in float64 (see compare: float32 kernels differ)
        r = compare(cfg, batch=8, new=64 if self.quick else 128, repeat=3, device="cuda", equal_in=torch.float64)
        t = r["tokens_per_s"]
        self.add(Row(
            "generation vs transformers", "ok" if r["identical"] else "fail",
            f"{r['ratio']:.2f}x ({t['hpcdist']:,.0f} vs {t['transformers']:,.0f} tokens/s)",
            f"batch 8, float32, latency {r['seconds']['hpcdist']:.3f} s vs {r['seconds']['transformers']:.3f} s per "
            f"batch, greedy identical in {r['identical_in']}: {r['identical']}, transformers "
            f"{r['versions']['transformers']}",
        ))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "hpcdist-out" / "gpu-check")
    ap.add_argument("--quick", action="store_true", help="fewer steps and smaller sizes")
    args = ap.parse_args(argv)
    ok, what = has_gpu()
    if not ok:
        print(f"gpu-check: no GPU: {what}")
        return NO_GPU_EXIT
    t0 = time.time()
    packages = install_missing(missing_modules(list(NEEDED)))
    sys.path.insert(0, str(ROOT))
    import torch

    facts: dict[str, Any] = {"gpu": what, "torch": torch.__version__, "cuda": torch.version.cuda}
    with tempfile.TemporaryDirectory(prefix="hpcdist-gpu-check-") as tmp:
        c = Checker(Path(tmp), args.quick)
        c.add(packages)
        if packages.status == "ok":
            c.guarded("hpcdist env", c.env_discovery)
            c.guarded("NCCL group (1 rank)", c.nccl_group)
            c.guarded("watchdog abort keeps hpcdist's summary", c.nccl_abort)
            c.guarded("bench", c.bench)
            c.guarded("train GPT-2 small", lambda: c.train("gpt2"))
            c.guarded("two ranks on one GPU refused", c.duplicate_gpu)
            c.guarded("CUDA tensors to ctx.results", c.cuda_results)
            c.guarded("infer_gpt bfloat16 memory", c.infer_bf16)
            c.guarded("deterministic training (params.deterministic)", c.determinism)
        c.guarded("generation vs transformers", c.generation)
        facts["seconds"] = round(time.time() - t0)
        write_table(c.rows, args.out, facts)
    print(f"written: {args.out / 'gpu_check.json'} and gpu_check.txt")
    return 0 if all(r.status != "fail" for r in c.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
