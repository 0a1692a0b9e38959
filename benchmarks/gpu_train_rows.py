"""The GPU check's training rows (benchmarks/gpu_check.py): GPT-2 small trained by ``train_gpt``
in bf16 and fp16, stopped half way and resumed (within tolerance, and bit for bit with
``params.deterministic``), and the bf16 run against the plain compiled loop. `TrainingRows` starts
their jobs through the check it is given (`Check`: benchmarks/gpu_rows.py's `Checker`), reads back what they wrote
(benchmarks/gpu_jobs.py) and adds the judges' rows (benchmarks/gpu_judges.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from benchmarks.gpu_jobs import (
    Job,
    after_save,
    checkpoints_of,
    first_step_s,
    model_digest,
    read_steps,
    resume_steps,
    scaler_state,
    window_rate,
    window_rates,
)
from benchmarks.gpu_judges import Row
from benchmarks.gpu_train_judges import judge_resume, judge_saved, judge_speed, judge_training


class Check(Protocol):
    """What the training rows need of the check that runs them (benchmarks/gpu_rows.py's
    `Checker`): its storage and settings, its job runner and its table. Named here, not imported,
    so the two modules do not import each other."""

    work: Path
    quick: bool
    gpus: int

    def gpu_sets(self, n: int = 1, backend: bool = True) -> list[str]: ...

    def submit(self, name: str, target: Sequence[str], sets: Sequence[str], timeout: float = 300) -> Job: ...

    def add(self, row: Row) -> None: ...

    def tokens(self) -> Path: ...

ROOT = Path(__file__).resolve().parents[1]
GPT2_SMALL: dict[str, Any] = {"n_layer": 12, "n_head": 12, "d_model": 768, "context": 1024, "vocab_size": 50257}
WINDOW = 10  # train_gpt's log_every in these runs: the steps of one timed window
SPEED_STEPS = 120  # the bf16 run's and the reference loop's: 11 timed windows of 10 steps after the
# first, about 4.5 s of steps at 38 ms, so that one slow window moves neither side's median


def thousands(rates: Iterable[float]) -> str:
    """Tokens/s figures in thousands, one after another: a row's windows, to see one that stands out."""
    return " ".join(f"{x / 1e3:.0f}" for x in rates) or "none"


def compile_cost(job: Job) -> str:
    """A train_gpt job's first step as its rank log gives it (compiling, or loading the cache)."""
    took = first_step_s(job.logs())
    return f"first step {took:.1f} s" if took is not None else "first step not logged"


class TrainingRows:
    """The training rows of the check `c` (its jobs, storage and table)."""

    def __init__(self, c: Check) -> None:
        self.c = c
        self.bf16_run: Path | None = None  # the bf16 training row's result: the speed row's train_gpt side

    def train_sets(self, steps: int, micro: int = 16, model: Mapping[str, Any] = GPT2_SMALL,
                   every: int | None = None, log_every: int = WINDOW) -> list[str]:
        shape = "params.model={" + ", ".join(f"{k}: {v}" for k, v in model.items()) + "}"
        return [*self.c.gpu_sets(1), f"params.data={self.c.tokens()}", shape, f"params.steps={steps}",
                f"params.batch.micro={micro}", "params.batch.accum=1",
                f"params.optim.warmup_steps={max(1, min(5, steps // 4))}", "params.eval.every=0",
                "params.eval.batches=1", f"params.checkpoint.every={every or max(1, steps // 2)}",
                f"params.log_every={log_every}", "timeout_s=300"]

    def train(self) -> None:
        """GPT-2 small in bf16 and in fp16 (the loss scaler), each uninterrupted; then the fp16 run
        again, stopped half way and resumed, against the uninterrupted one."""
        import torch

        from hpcdist.store.results import read_attrs
        from hpcdist.train.metrics import peak_tflops

        steps, speed = (20, 20) if self.c.quick else (60, SPEED_STEPS)
        sets = self.train_sets(steps)
        whole: Path | None = None
        for precision in ("bf16", "fp16"):
            check = f"train GPT-2 small {precision}" + (" + loss scaler" if precision == "fp16" else "")
            # the bf16 run is the speed row's train_gpt side: its one save comes after its last timed
            # window, as the reference loop saves nothing; the fp16 run saves half way too (resume, infer)
            job = self.c.submit(f"gpt2-{precision}", ["jobs/train_gpt.yaml"],
                                [*(self.train_sets(speed, every=speed) if precision == "bf16" else sets),
                                 f"params.precision={precision}"], timeout=420)
            if job.code != 0 or job.result is None:
                self.c.add(Row(check, "fail", "", job.why))
                continue
            ckpts = checkpoints_of(self.c.work / f"gpt2-{precision}" / "checkpoints")
            scaler = scaler_state(ckpts[max(ckpts)]) if ckpts else {}
            peak = peak_tflops(torch.cuda.get_device_name(0), precision) if self.c.gpus else None
            row = judge_training(check, read_attrs(job.result), list(read_steps(job.result).values()), precision,
                                 peak, scaler)
            saved = f"; {after_save(job.result, WINDOW, steps // 2)}" if precision == "fp16" else ""
            self.c.add(replace(row, detail=f"{row.detail}; {compile_cost(job)}{saved}"))
            whole = job.result
            if precision == "bf16":
                self.bf16_run = job.result
        check = "resume = uninterrupted fp16 run (within tolerance)"
        if whole is None:
            self.c.add(Row(check, "fail", "", "no uninterrupted fp16 run to compare with"))
            return
        self.c.add(self.resume_pair("gpt2-fp16-resumed", ("gpt2-fp16", whole), [*sets, "params.precision=fp16"],
                                    steps, exact=False, check=check,
                                    save_check="checkpoint save (CUDA state, run_steps)"))

    def speed(self, window: int = WINDOW) -> None:
        """train_gpt / the plain compiled loop (benchmarks/train_vs_plain.py, submitted as a script),
        tokens/s, GPT-2 small, micro 16, bf16: train_gpt's side is the bf16 training row's run
        (compiled: params.compile auto on CUDA), or a run of its own when that row wrote none."""
        import torch

        from hpcdist.store.results import read_attrs
        from hpcdist.train.metrics import peak_tflops

        check = "train_gpt / plain compiled loop (GPT-2 small, bf16), MFU"
        steps = 20 if self.c.quick else SPEED_STEPS  # the bf16 row's run's, which saves only at its end
        ours = self.bf16_run
        if ours is None:
            job = self.c.submit("gpt2-speed", ["jobs/train_gpt.yaml"],
                                [*self.train_sets(steps, every=steps, log_every=window), "params.precision=bf16"],
                                timeout=420)
            if job.code != 0 or job.result is None:
                self.c.add(Row(check, "fail", "", f"train_gpt failed: {job.why}"))
                return
            ours = job.result
        report = self.c.work / "reference.json"
        script = ["--", str(ROOT / "benchmarks" / "train_vs_plain.py"), "--plain-only",
                  "--device", "cuda" if self.c.gpus else "cpu", "--compile", "--precision", "bf16",
                  "--micro", "16", "--model", json.dumps(GPT2_SMALL), "--steps", str(steps),
                  "--window", str(window), "--repeat", "1", "--tokens", str(self.c.tokens()), "--json", str(report)]
        ref = self.c.submit("plain-ref", script, self.c.gpu_sets(1, backend=False), timeout=420)
        reference = json.loads(report.read_text()) if ref.code == 0 and report.exists() else None
        peak = peak_tflops(torch.cuda.get_device_name(0), "bf16") if self.c.gpus else None
        if reference is None:
            self.c.add(Row(check, "fail", "", f"the reference loop failed: {ref.why}"))
            return
        row = judge_speed(check, read_attrs(ours), window_rate(ours, window), reference, peak)
        windows = (f"train_gpt {thousands(window_rates(ours, window).values())}, "
                   f"reference {thousands(reference.get('plain_window_rates', []))}")
        self.c.add(replace(row, detail=f"{row.detail}; each window, k tokens/s: {windows}"))

    def determinism(self) -> None:
        """params.deterministic: a run stopped half way and resumed equals the uninterrupted one, bit for bit."""
        model = {**GPT2_SMALL} if self.c.gpus else {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32}
        sets = [*self.train_sets(8, micro=8, model=model, every=4, log_every=1), "params.deterministic=true",
                *(["params.precision=bf16"] if self.c.gpus else [])]
        job = self.c.submit("det-whole", ["jobs/train_gpt.yaml"], sets, timeout=420)
        check = "resume = uninterrupted, bit for bit (params.deterministic)"
        if job.code != 0 or job.result is None:
            self.c.add(Row(check, "fail", "", f"the uninterrupted run failed: {job.why}"))
            return
        self.c.add(self.resume_pair("det-resumed", ("det-whole", job.result), sets, 8, exact=True, check=check))

    def resume_pair(self, name: str, whole: tuple[str, Path], sets: Sequence[str], steps: int, *, exact: bool,
                    check: str, save_check: str | None = None) -> Row:
        """Run `sets` to steps / 2 (params.run_steps) under work/NAME, resubmit it to finish, and judge
        it against the uninterrupted run `whole` (its work folder's name, its result file); the first
        half's own row too when `save_check` is given."""
        from hpcdist.store import verify
        from hpcdist.store.results import read_attrs

        half = steps // 2
        first = self.c.submit(name, ["jobs/train_gpt.yaml"], [*sets, f"params.run_steps={half}"], timeout=420)
        ckpts = checkpoints_of(self.c.work / name / "checkpoints")
        verified: str | None = None
        if half in ckpts:
            try:
                verify(ckpts[half])
            except Exception as exc:
                verified = f"{type(exc).__name__}: {exc}"
        attrs = read_attrs(first.result) if first.result is not None else {}
        saved = judge_saved(save_check or check, first.code, attrs, ckpts, half, verified, first.why)
        if save_check is not None:
            self.c.add(saved)
        if saved.status != "ok":
            return Row(check, "fail", "", f"the first half failed: {saved.detail}")
        second = self.c.submit(name, ["jobs/train_gpt.yaml"], sets, timeout=420)
        if second.code != 0 or second.result is None:
            return Row(check, "fail", "", f"the resubmission failed: {second.why}")
        a = checkpoints_of(self.c.work / whole[0] / "checkpoints").get(steps)
        b = checkpoints_of(self.c.work / name / "checkpoints").get(steps)
        if a is None or b is None:
            return Row(check, "fail", "", f"no final checkpoint of step {steps} (uninterrupted {a}, resumed {b})")
        scalers = (scaler_state(a), scaler_state(b)) if not exact else None
        digests = (model_digest(a), model_digest(b)) if exact else None
        row = judge_resume(check, read_steps(whole[1]), read_steps(second.result), resume_steps(second.result),
                           half, exact=exact, scalers=scalers, digests=digests)
        return replace(row, detail=f"{row.detail}; {compile_cost(first)}, resumed {compile_cost(second)}")
