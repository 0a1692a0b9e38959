"""``CheckpointManager``: when ``train_gpt`` saves a checkpoint and when it stops, on the node.

The loop asks once a step, as torchtitan's does, and the manager decides::

    if checkpointer.save(step, last_step=step == params.steps):
        break

- **every ``params.checkpoint.every`` steps, and the last step** (`last_step`) save;
- **a preemption or time-out signal** (the site's signal or SIGTERM, ``Context.should_stop``)
  saves and stops, and the job requeues; at the last step the signal is ignored and the run
  finishes. The ranks agree on the signal (a collective and a host copy) at every save and about
  every ``STOP_CHECK_S`` seconds between, at most ``log_every`` steps apart, paced by the step
  time the loop's ``StepLog`` measured;
- **``params.run_steps`` steps of this start** save and stop (resubmit to go on).

A stop's checkpoint and the last step's are waited for (`final`); the others may be written in the
background (``params.checkpoint.background``). What a checkpoint holds, and the resume, are
``hpcdist.train.resume``'s; each commit's time and rate go to the trackers from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpcdist.train.failure import named
from hpcdist.train.resume import save

if TYPE_CHECKING:
    from hpcdist.train.run import Run
    from hpcdist.train.step_log import StepLog

STOP_CHECK_S = 1.0  # agree on should_stop() at least this often (once a step when steps are slower)


def stop_every(log_every: int, step_s: float) -> int:
    """How many steps apart the ranks agree on ``should_stop()`` (a collective and a host copy):
    every step when a step takes `STOP_CHECK_S` or more, else about every second, at most
    `log_every` apart. `step_s` must be the same on every rank (``Window.flush``'s mean)."""
    if step_s <= 0:
        return 1
    return max(1, min(log_every, int(STOP_CHECK_S / step_s)))


class CheckpointManager:
    """The save-and-stop policy of one start of a training run (built after its resume)."""

    def __init__(self, run: Run, log: StepLog) -> None:
        """`log`: the loop's step log, whose mean step time paces the stop agreement."""
        self.run, self.log = run, log
        self.start = run.step
        self.stop = ""  # why the loop stopped: "preempted" (a signal), "run_steps", or "" (it did not)
        self.tracked = len(run.metrics.rows["checkpoints"])  # rows sent to the trackers (those before this start were)

    @property
    def check_every(self) -> int:
        """Steps between two agreements on ``should_stop()``, from the last flush's step time."""
        return stop_every(self.run.params.log_every, self.log.step_s)

    def _interval(self, step: int) -> bool:
        return step % self.run.params.checkpoint.every == 0

    def _run_ends(self, step: int) -> bool:
        run_steps = self.run.params.run_steps
        return bool(run_steps) and step - self.start >= (run_steps or 0)

    def due(self, step: int) -> bool:
        """Whether `save` may save or agree on a stop at `step`: the loop flushes its step log
        first, so that the checkpoint holds every step's row. Asked before that flush (which
        may change `check_every`)."""
        return (self._interval(step) or step == self.run.params.steps or self._run_ends(step)
                or step % self.check_every == 0)

    def save(self, step: int, *, last_step: bool = False) -> bool:
        """Save `step`'s checkpoint if the policy says so (always on the `last_step`); whether the
        loop stops after it (then ``stop`` says why)."""
        r = self.run
        saves = last_step or self._interval(step)
        run_ends = self._run_ends(step)
        if (saves or run_ends or step % self.check_every == 0) and self._signalled(step):
            if last_step:  # just finish
                r.api.ignore_stop()
            else:
                self.stop = "preempted"
                r.ctx.log.warning(
                    "%s signal received: checkpointing at step %d (%s; %d time-out(s), %d requeue(s) so far)",
                    r.api.stop_signal, step, r.api.stop_kind, r.timeouts, r.requeues,
                )
        elif run_ends and not last_step:
            self.stop = "run_steps"
        if self.stop or saves:
            how = "sharded checkpoint save" if r.sharded else "checkpoint gather to rank 0"
            with named(r, f"training step {step} ({how})"):
                save(r, final=bool(self.stop) or last_step)
            self._track()
        return bool(self.stop)

    def _signalled(self, step: int) -> bool:
        """The ranks' agreement on ``should_stop()`` (a collective: every rank asks at the same steps)."""
        with named(self.run, f"training step {step} (stop agreement all_reduce)"):
            return self.run.api.should_stop()

    def _track(self) -> None:
        """Each checkpoint's save time and rate to the trackers, from the metrics' checkpoint rows."""
        rows = self.run.metrics.rows["checkpoints"]
        for row in rows[self.tracked:]:
            values = dict(zip(("step", "op", "bytes", "seconds", "mb_per_s"), row, strict=False))
            self.run.api.track(int(values["step"]), **{f"checkpoint_{values['op']}_s": values["seconds"],
                                                      f"checkpoint_{values['op']}_mb_per_s": values["mb_per_s"]})
        self.tracked = len(rows)
