"""When a step saves: the policy of ``CheckpointManager.save(step, last_step=...)``, on the node.

The loop asks once a step, as torchtitan's does, and the manager decides with this policy:

- **every `every` steps, and the last step** (`last_step`) save;
- **a preemption or time-out signal** (the site's signal or SIGTERM, ``Context.should_stop``)
  saves and stops, and the job requeues; at the last step the signal is ignored and the run
  finishes. The ranks agree on the signal (a collective and a host copy) at every save and about
  every `STOP_CHECK_S` seconds between, at most `log_every` steps apart, paced by the mean step
  time the loop measured (`step_s`, the same on every rank);
- **`run_steps` steps of this start** save and stop (resubmit to go on).

A stop's checkpoint and the last step's are waited for (`final`); the others may be written in the
background. No I/O and no collective here: the manager asks the ranks (`signalled`) and saves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

STOP_CHECK_S = 1.0  # agree on should_stop() at least this often (once a step when steps are slower)
PREEMPTED, RUN_STEPS = "preempted", "run_steps"  # why the loop stops (`Decision.stop`)


def stop_every(log_every: int, step_s: float) -> int:
    """How many steps apart the ranks agree on ``should_stop()`` (a collective and a host copy):
    every step when a step takes `STOP_CHECK_S` or more, else about every second, at most
    `log_every` apart. `step_s` must be the same on every rank (``Window.flush``'s mean)."""
    if step_s <= 0:
        return 1
    return max(1, min(log_every, int(STOP_CHECK_S / step_s)))


@dataclass(frozen=True)
class Decision:
    """What one step does: whether it saves, whether that save is waited for, why the loop stops
    ("" when it goes on), and whether a signal came at the last step (then ignored)."""

    saves: bool
    final: bool = False
    stop: str = ""
    signal_ignored: bool = False


@dataclass
class SavePolicy:
    """The save-and-stop policy of one start of a run (made after its resume, at step `start`)."""

    every: int
    start: int = 0
    run_steps: int | None = None
    log_every: int = 10
    step_s: Callable[[], float] = lambda: 0.0  # the loop's mean step time, the same on every rank
    background: bool = False  # saves that are not final go on in the background

    @property
    def check_every(self) -> int:
        """Steps between two agreements on ``should_stop()``, from the last measured step time."""
        return stop_every(self.log_every, self.step_s())

    def _interval(self, step: int) -> bool:
        return step % self.every == 0

    def _run_ends(self, step: int) -> bool:
        return bool(self.run_steps) and step - self.start >= (self.run_steps or 0)

    def due(self, step: int, last_step: bool = False) -> bool:
        """Whether `decide` may save or agree on a stop at `step`: the loop flushes what the
        checkpoint records first. Asked before that flush (which may change `check_every`)."""
        return self._interval(step) or last_step or self._run_ends(step) or step % self.check_every == 0

    def decide(self, step: int, last_step: bool, signalled: Callable[[], bool]) -> Decision:
        """This step's `Decision`; `signalled` is the ranks' agreement on ``should_stop()`` (a
        collective), asked at the same steps on every rank."""
        saves = last_step or self._interval(step)
        run_ends = self._run_ends(step)
        stop, ignored = "", False
        if (saves or run_ends or step % self.check_every == 0) and signalled():
            if last_step:  # just finish
                ignored = True
            else:
                stop = PREEMPTED
        elif run_ends and not last_step:
            stop = RUN_STEPS
        return Decision(saves=bool(stop) or saves, final=bool(stop) or last_step, stop=stop, signal_ignored=ignored)
