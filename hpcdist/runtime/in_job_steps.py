"""The in-job supervisor's srun steps (``hpcdist.runtime.in_job``): what srun says of their tasks,
and the line at each step's start that the login side reads back."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpcdist.config.contract import HUNG_EXIT
from hpcdist.scheduler.hostlist import task_end

HUNG_WORDS = "its collective hung"  # how srun's report of a rank that ended itself after a hang is read
# the supervisor's line at each step's start, in the batch log: the login side counts the ranks of the last
STEP_LINE = re.compile(r"^hpcdist: in-job step \d+ on \S+ \((\d+) ranks\)", re.MULTILINE)


def ranks_of_last_step(logs: Sequence[Path]) -> int | None:
    """How many ranks the supervisor's last step had, as the batch log (`logs`: its output and
    error files) says; None when no log says."""
    found = None
    for log in logs:
        try:
            with log.open("rb") as f:
                text = f.read(1 << 26).decode(errors="replace")
        except OSError:
            continue
        counts = STEP_LINE.findall(text)
        found = int(counts[-1]) if counts else found
    return found


@dataclass
class Step:
    """One srun of the supervisor's: task i runs rank ``ranks[i]``; srun's report of each rank whose
    task ended badly (``ended``: node, and the signal's name, or how a rank whose collective hung
    ended itself (``HUNG_EXIT``, NCCL's path), or "" for any other exit code: the job's own error),
    and the ranks started again elsewhere (``replaced``), whose end is not this step's failure."""

    proc: subprocess.Popen[bytes]
    ranks: list[int]
    ended: dict[int, tuple[str, str]] = field(default_factory=dict)
    replaced: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.relay = threading.Thread(target=self.read, daemon=True)  # srun's stderr, read as it comes
        self.relay.start()

    def read(self) -> None:
        """srun's own messages into the batch log, as they come; each failed task's end noted."""
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            sys.stderr.buffer.write(raw)
            sys.stderr.flush()
            end = task_end(raw.decode(errors="replace"))
            if end is not None:
                node, tasks, how = end
                for task in tasks:
                    if task < len(self.ranks):
                        signal = "" if how.startswith("Exited") else how
                        if how.strip() == f"Exited with exit code {HUNG_EXIT}":
                            signal = f"{HUNG_WORDS}: it ended itself, exit {HUNG_EXIT}"
                        self.ended.setdefault(self.ranks[task], (node, signal))

    def failures(self) -> dict[int, tuple[str, str]]:
        return {r: end for r, end in list(self.ended.items()) if r not in self.replaced}

