"""The GPU check's rows (benchmarks/gpu_check.py): `Checker` starts each row's job on the
``local`` site as a user would (``hpcdist submit --wait`` through the command line, the
Executor, the bootstrap alone, or in process), reads back what it wrote (benchmarks/gpu_jobs.py)
and adds the judge's Row (benchmarks/gpu_judges.py). A failed row is a Row; the others still run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.gpu_jobs import (
    ABORT_SCRIPT,
    NCCL_REPORT_SCRIPT,
    Job,
    checkpoints_of,
    largest_tensor_bytes,
    submitted,
    why,
)
from benchmarks.gpu_judges import (
    Row,
    judge_abort,
    judge_bench,
    judge_cuda_results,
    judge_ddp_gpu,
    judge_duplicate,
    judge_env,
    judge_generation,
    judge_infer,
    judge_nccl,
    judge_staging,
)
from benchmarks.gpu_train_rows import GPT2_SMALL, TrainingRows

if TYPE_CHECKING:
    import hpcdist

ROOT = Path(__file__).resolve().parents[1]
ABORT_TIMEOUT_S = 5




class Checker:
    """Runs each row's job on the `local` site as a user would, storage under `work`.

    `gpus`: the machine's (torch's count when None). With none (the CPU tests) the jobs ask for no
    GPU and name no backend, so the judges see what a CPU run writes and fail the GPU rows."""

    def __init__(self, work: Path, quick: bool, gpus: int | None = None) -> None:
        if gpus is None:
            import torch

            gpus = torch.cuda.device_count()
        self.work = work
        self.quick = quick
        self.gpus = gpus
        self.rows: list[Row] = []
        self.training = TrainingRows(self)  # the training rows (benchmarks/gpu_train_rows.py)
        self.only: list[str] = []  # words: run only the rows whose name holds one (gpu_check.py --only)
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def storage(self, name: str) -> list[str]:
        out = []
        for key in ("results", "checkpoints", "scratch", "logs"):
            out += ["--set", f"site.storage.{key}={self.work / name / key}"]
        return out

    def gpu_sets(self, n: int = 1, backend: bool = True) -> list[str]:
        """A job of `n` ranks, a GPU each (the local site gives the first n); NCCL named when `backend`."""
        if not self.gpus:
            return ["resources.nodes=1", "resources.tasks_per_node=1"]
        return ["resources.nodes=1", f"resources.tasks_per_node={n}", f"resources.gpus_per_node={n}",
                *(["backend=nccl"] if backend else [])]

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hpcdist.cli", *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def submit(self, name: str, target: Sequence[str], sets: Sequence[str], timeout: float = 300) -> Job:
        """`hpcdist submit --site local TARGET --set ... --wait` (target: a spec, or ``--`` and a
        script with its arguments), storage under work/NAME; a job still running when the wait
        gives up is cancelled, so it does not hold the GPU for the next row."""
        spec = [t for t in target[:1] if t != "--"]
        script = list(target[len(spec):])
        args = ["submit", *spec, "--site", "local", "--wait", "--wait-timeout", str(int(timeout)), *self.storage(name)]
        for s in sets:
            args += ["--set", s]
        t = time.time()
        try:
            proc = self.cli(*args, *script, timeout=timeout + 60)
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            code = 124
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        job = Job(code, out, err, time.time() - t, submitted(out))
        if job.info.job_id and not re.search(rf"job {re.escape(job.info.job_id)} finished:", out):
            try:
                self.cli("cancel", job.info.job_id, "--site", "local", timeout=60)
            except subprocess.TimeoutExpired:
                print(f"  could not cancel job {job.info.job_id} within 60 s; it may still hold the GPU", flush=True)
        return job

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(f"  {row.check}: {row.status} {row.figure} {row.detail}", flush=True)

    def guarded(self, check: str, fn: Callable[[], None]) -> None:
        """Run one row (a few, for `bench` and `train`); a failure is a row. With `only`, just the
        rows whose name contains one of its words."""
        if self.only and not any(w in check.lower() for w in self.only):
            return
        try:
            fn()
        except Exception as exc:  # a failed check is a row, the others still run
            self.add(Row(check, "fail", "", f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"))

    # -- hpcdist env
    def env_discovery(self) -> None:
        proc = self.cli("env", timeout=120)
        self.add(judge_env(proc.returncode, proc.stdout, self.gpus))

    # -- the NCCL group and its watchdog
    def nccl_group(self, timeout_s: int = 60) -> None:
        script = self.work / "nccl_report.py"
        script.write_text(NCCL_REPORT_SCRIPT)
        job = self.submit("nccl", ["--", str(script)], [*self.gpu_sets(1, backend=False), f"timeout_s={timeout_s}",
                                                        "env={TORCH_CPP_LOG_LEVEL: INFO}"], timeout=180)
        self.add(judge_nccl(job.code, job.logs(), timeout_s, job.why))

    def nccl_abort(self) -> None:
        from hpcdist.runtime.abort import GRACE_S

        script = self.work / "nccl_abort.py"
        script.write_text(ABORT_SCRIPT)
        job = self.submit("abort", ["--", str(script)], [*self.gpu_sets(1), f"timeout_s={ABORT_TIMEOUT_S}"],
                          timeout=240)
        dumps = sorted(p.name for p in (self.work / "abort" / "logs").rglob("flight_recorder_rank*"))
        self.add(judge_abort(job.code, job.out, job.took, ABORT_TIMEOUT_S, GRACE_S, dumps))

    # -- benchmarks
    def bench(self) -> None:
        sizes = ["params.max_bytes=16M"] if self.quick else ["params.max_bytes=256M"]
        common = ["resources.time_min=10", "params.enforce_minimums=false", "params.check=true",
                  "params.ops=[all_reduce, all_gather, reduce_scatter, broadcast]", *sizes]
        job = self.submit("nccl-bench", ["jobs/bench_collectives.yaml"],
                          [*self.gpu_sets(1), "params.paths=[torch]", *common])
        self.add(self._bench_row("bench_collectives torch/nccl", job))
        if self.gpus < 2:
            self.add(Row("bench_p2p torch/nccl (pingpong, unidir, bidir)", "skip", "",
                         "not run: needs 2 GPUs (NCCL refuses two ranks on one GPU); bidir's order under NCCL is "
                         "checked on CPU by tests/test_bench_p2p_order.py"))
        else:
            job = self.submit("p2p", ["jobs/bench_p2p.yaml"], [*self.gpu_sets(2), "params.paths=[torch]",
                                                                "params.enforce_minimums=false"])
            self.add(self._bench_row("bench_p2p torch/nccl (pingpong, unidir, bidir)", job))
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
        job = self.submit("mpicuda", ["jobs/bench_collectives.yaml"],
                          [*self.gpu_sets(1), "params.paths=[mpi]", "params.mpi_buffers=cuda", *common])
        self.add(self._bench_row("bench_collectives mpi/cuda", job))

    @staticmethod
    def _bench_row(check: str, job: Job) -> Row:
        if job.code != 0 or job.result is None:
            return Row(check, "fail", "", job.why)
        import h5py

        best, wrong, rows = 0.0, 0, 0
        with h5py.File(job.result) as f:
            def visit(_: str, obj: Any) -> None:
                nonlocal best, wrong, rows
                if isinstance(obj, h5py.Group) and "algbw_gbps" in obj:
                    best = max(best, float(max(obj["algbw_gbps"][()], default=0.0)))
                    wrong += int(obj["wrong"][()].sum())
                    rows += len(obj["algbw_gbps"])

            f.visititems(visit)
        return judge_bench(check, rows, wrong, best, job.result.name)

    # -- the token file the training rows train on (benchmarks/gpu_train_rows.py)
    def tokens(self) -> Path:
        tokens = self.work / "tokens.h5"
        if not tokens.exists():
            texts = [str(p) for p in (ROOT / "README.md", *sorted((ROOT / "hpcdist").rglob("*.py")))]
            proc = self.cli("data", "prepare", *texts, "-o", str(tokens), timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"hpcdist data prepare failed: {why(proc.returncode, proc.stdout, proc.stderr)}")
        return tokens

    # -- a user's torchrun-style script
    def ddp_example(self) -> None:
        n = max(1, self.gpus)
        job = self.submit("ddp-gpu", ["--", str(ROOT / "examples" / "ddp_gpu.py"), "--epochs", "3"],
                          self.gpu_sets(n, backend=False), timeout=240)
        self.add(judge_ddp_gpu(job.code, job.logs(), n, job.why))

    # -- a binding the local site never makes
    def duplicate_gpu(self) -> None:
        """Two ranks given one GPU: hpcdist's one-line refusal at check-in, not NCCL's "Duplicate GPU".

        The ranks are started as the local launcher starts them, but both with CUDA_VISIBLE_DEVICES=0
        (what a site whose binding gives two tasks one GPU does): the local site gives each task its
        own GPUs, so only the bootstrap alone can be given this."""
        args = [sys.executable, "-m", "hpcdist.runtime.entry", "jobs/smoke.yaml", "--site", "local",
                *self.storage("dup"), "--set", "resources.tasks_per_node=2", "--set", "timeout_s=60"]
        job = f"dup{os.getpid()}"
        t = time.time()
        procs = [subprocess.Popen(args, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={
            **self.env, "CUDA_VISIBLE_DEVICES": "0", "SUBMITIT_LOCAL_JOB_ID": job, "SUBMITIT_LOCAL_GLOBALID": str(r),
            "SUBMITIT_LOCAL_LOCALID": str(r), "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_NODEID": "0",
            "SUBMITIT_LOCAL_JOB_NUM_NODES": "1"}) for r in range(2)]
        outs = [p.communicate(timeout=180)[0] for p in procs]
        self.add(judge_duplicate([p.returncode for p in procs], "\n".join(outs), time.time() - t))

    # -- the Python API's submit
    def cuda_results(self, job: Callable[[hpcdist.Context], dict[str, Any]]) -> None:
        """A function run by hpcdist.Executor gives CUDA tensors to ctx.results: numbers in the file.

        `job` is gpu_check.py's ``_cuda_results_job``: defined in the script run as ``__main__``, it
        travels by value, as a function of a user's script does."""
        import h5py

        import hpcdist
        from hpcdist.store.results import read_attrs, read_table

        storage = {f"site.storage.{k}": str(self.work / "executor" / k) for k in ("results", "checkpoints", "scratch",
                                                                                   "logs")}
        gpu: dict[str, Any] = {"gpus_per_node": 1, "backend": "nccl"} if self.gpus else {}
        ex = hpcdist.Executor(site="local", tasks_per_node=1, timeout_s=120, time_min=5, set=storage, **gpu)
        returned = ex.submit(job).result(timeout_s=240)
        path = Path(returned["result"])
        with h5py.File(path, "r") as f:
            table = read_table(f["steps"])
        self.add(judge_cuda_results(returned, read_attrs(path), table))

    def infer_bf16(self) -> None:
        """infer_gpt in bfloat16 from the fp16 run's checkpoint: weights and KV cache in 2 bytes a value."""
        ckpts = checkpoints_of(self.work / "gpt2-fp16" / "checkpoints")
        if not ckpts:
            self.add(Row("infer_gpt bfloat16 memory", "skip", "", "no checkpoint: the training check wrote none"))
            return
        prompts = self.work / "prompts.txt"
        prompts.write_text("\n".join(f"The cluster node {i} reports" for i in range(8)) + "\n")
        job = self.submit("infer", ["jobs/infer_gpt.yaml"], [
            *self.gpu_sets(1), f"params.checkpoint={ckpts[max(ckpts)]}", f"params.prompts={prompts}", "params.tp=1",
            "params.dtype=bfloat16", "params.max_new_tokens=64", "params.end_token=null"])
        if job.code != 0 or job.result is None:
            self.add(Row("infer_gpt bfloat16 memory", "fail", "", job.why))
            return
        import h5py

        from hpcdist.model.config import GPTConfig
        from hpcdist.store.results import read_table

        with h5py.File(job.result) as f:
            dtype = str(f.attrs["dtype"])
            ranks = read_table(f["ranks"])
            cfg = GPTConfig(**json.loads(f.attrs["model_config_json"]))
        self.add(judge_infer(dtype, cfg.num_params(), cfg.vocab_size, cfg.d_model, int(ranks["weight_bytes"][0]),
                             int(ranks["kv_cache_peak_bytes"][0]), int(ranks["device_peak_bytes"][0]),
                             int(ranks["load_peak_bytes"][0]), largest_tensor_bytes(ckpts[max(ckpts)])))

    def staging(self) -> None:
        report = self.work / "staging.json"
        job = self.submit("staging", ["--", str(ROOT / "benchmarks" / "gpu_ckpt_staging.py"), "--json", str(report),
                                      *([] if self.gpus else ["--device", "cpu", "--size-mb", "8"])],
                          self.gpu_sets(1, backend=False), timeout=240)
        data = json.loads(report.read_text()) if report.exists() else None
        self.add(judge_staging(job.code, data, job.why))

    # -- in process
    def generation(self) -> None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from infer_vs_hf import compare

        from hpcdist.model.config import GPTConfig

        cfg = GPTConfig(**{**GPT2_SMALL, "context": 1024})
        import torch

        # timed in float32; greedy equality judged in float64 (see compare: float32 kernels differ)
        r = compare(cfg, batch=8, new=64 if self.quick else 128, repeat=3, device="cuda", equal_in=torch.float64)
        self.add(judge_generation(r))
