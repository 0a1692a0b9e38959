"""One train_gpt checkpoint followed through the code: from the loop's ``save(step, last_step=...)``
to its commit, and back through the resume's ``load()``; how often each hpcdist module is entered.

One process (world size 1, CPU), the suite's 1-layer GPT on a token file made from docs/. The
main thread's calls are traced with ``sys.setprofile``. A module is *entered* when one of its
functions is called from another module's frame while no frame of it is on the stack; the calls
one frame makes to the same module one after the other (a loop over the tree's leaves) are one
entry. Prints each module's entries along the trip, in the order first entered, and exits 1 if
any module is entered more than `--most` times (2).

The GPT's own knowledge on top of the store is two modules, each entered at most twice:
``hpcdist.model.checkpoint`` makes the model's tree on the way out and its state dict from what
every rank read on the way back; ``hpcdist.model.shapes`` tests the chosen file's shapes on rank
0's verified read before any rank reads a tensor (for a sharded checkpoint, before any shard is
filled). They were one module, entered three times. (docs/layout.md shows the figure.)

    .venv/bin/python benchmarks/checkpoint_trace.py [--most 2] [--path]
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class Trip:
    """The hpcdist modules a stretch of the main thread enters, in order (``sys.setprofile``).

    An entry is a call into a module from another one while no frame of it is on the stack, that
    itself goes on into a third module before it returns: a step of the trip through the layers.
    A call that returns without entering another module (a getter, a digest, a leaf of the tree)
    is a *use* of that module, counted apart; so are the calls one frame makes to the same module
    one after the other (a loop), and a generator resumed (a context manager's exit)."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []  # [module, the module it was entered from, went on], in order
        self._last: dict[str, tuple[FrameType | None, int]] = {}  # module -> the frame that last entered it, and where
        self._stack: list[tuple[str, int, int]] = []  # open calls: (module, frame id, index in `calls`)

    @staticmethod
    def _module(frame: FrameType | None) -> str:
        while frame is not None:
            name = str(frame.f_globals.get("__name__", ""))
            if name.startswith("hpcdist"):
                return name
            frame = frame.f_back
        return ""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        name = str(frame.f_globals.get("__name__", ""))
        if not name.startswith("hpcdist") or event not in ("call", "return"):
            return
        if event == "return":
            if self._stack and self._stack[-1][1] == id(frame):
                self._stack.pop()
            return
        caller = self._module(frame.f_back)
        if caller == name or any(module == name for module, _, _ in self._stack):
            return
        if self._stack:
            self.calls[self._stack[-1][2]][2] = True  # the module open below went on into this one
        resumed = frame.f_code.co_flags & inspect.CO_GENERATOR and frame.f_lasti > 0
        last = self._last.get(name)
        if last is not None and (resumed or last[0] is frame.f_back):  # the same frame calling it again
            index = last[1]
        else:
            index = len(self.calls)
            self.calls.append([name, caller, False])
        self._last[name] = (frame.f_back, index)
        self._stack.append((name, id(frame), index))

    @property
    def entries(self) -> list[tuple[str, str]]:
        return [(module, caller) for module, caller, went_on in self.calls if went_on]

    @property
    def uses(self) -> Counter[str]:
        return Counter(module for module, _, went_on in self.calls if not went_on)

    def __enter__(self) -> Trip:
        sys.setprofile(self)
        return self

    def __exit__(self, *_: object) -> None:
        sys.setprofile(None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--most", type=int, default=2, help="the most entries a module may have")
    parser.add_argument("--path", action="store_true", help="print every entry in order (module <- caller)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hpcdist-ckpt-trace-"))
    tokens = work / "tokens.h5"
    subprocess.run([sys.executable, "-m", "hpcdist.cli", "data", "prepare", *sorted(map(str, ROOT.glob("docs/*.md"))),
                    "-o", str(tokens)], cwd=ROOT, check=True, capture_output=True)
    os.chdir(work)  # the context's own files (its result) go under hpcdist-out/ there
    import hpcdist
    from hpcdist.train.checkpoint import TrainState, policy
    from hpcdist.train.loop import build
    from hpcdist.train.params import TrainParams
    from hpcdist.train.resume import resume
    from hpcdist.train.step_log import StepLog

    params = TrainParams.model_validate({
        "data": str(tokens), "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32}, "steps": 2,
        "batch": {"micro": 4, "accum": 1}, "checkpoint": {"every": 1, "keep_last": 2, "background": False},
        "compile": False, "optim": {"warmup_steps": 1}, "eval": {"every": 0, "batches": 1},
    })
    ctx = hpcdist.init(name="checkpoint-trace", checkpoint_dir=work / "checkpoints")
    run = build(ctx.job, ctx, params)
    resume(run, TrainState(run))  # a fresh start: nothing to load
    run.step = 1
    checkpoints = ctx.checkpoints
    checkpoints.schedule(policy(run, StepLog(run)), TrainState(run))
    with Trip() as saving:
        checkpoints.save(run.step, last_step=False)  # the loop's call: the policy saves step 1 and commits it
    again = build(ctx.job, ctx, params)
    with Trip() as loading:
        resume(again, TrainState(again))  # the resume's load: the step chosen, read, verified, restored
    ctx.close()
    os.chdir(ROOT)
    shutil.rmtree(work, ignore_errors=True)
    assert again.step == 1, again.step
    entries = saving.entries + loading.entries
    counts = Counter(module for module, _ in entries)
    if args.path:
        for module, caller in entries:
            print(f"{module} <- {caller}")
    width = max(map(len, counts))
    for module in dict.fromkeys(module for module, _ in entries):
        print(f"{module:<{width}}  {counts[module]}")
    over = {m: n for m, n in counts.items() if n > args.most}
    print(f"{len(counts)} modules, {len(entries)} entries; over {args.most}: {over or 'none'}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
