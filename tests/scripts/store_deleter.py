"""carol, outside alice's group, at alice's job's store (ADDR PORT): she lists its keys, as torch's
store lets anyone who reaches the port, and from then on deletes the roll-call answers of ranks 1
and 2 as fast as the store lets her, until the file STOP appears, the store goes, or two minutes pass. A rank
that answers is then, to whoever reads the store, a rank that did not. Prints how many answers
she deleted, as JSON."""

import datetime
import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

addr, port, stop = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
store = dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=10))
seat = next(n for n in store.list_keys() if n.endswith("/hpcdist/join/0"))
base = seat[: -len("join/0")]  # hpcdist/<launch>/hpcdist/
answers = [base + f"rollcall/{r}" for r in (1, 2)]
deleted, deadline = 0, time.monotonic() + 120
try:
    while not stop.exists() and time.monotonic() < deadline:
        for _ in range(200):
            for key in answers:
                deleted += bool(store.delete_key(key))
except RuntimeError:  # the store went with rank 0's end (torch's DistNetworkError)
    pass
print(json.dumps({"deleted": deleted}), flush=True)
