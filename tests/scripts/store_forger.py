"""carol, outside alice's group, at alice's job's store (ADDR PORT): she lists its keys, as torch's
store lets anyone who reaches the port, and writes hpcdist's own messages under the names she
read: the failure that stops every rank of a `python` job, the host table, a rank's seat.
Prints the key names it saw, as JSON."""

import datetime
import json
import sys

import torch.distributed as dist

addr, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=10))
names = store.list_keys()
seat = next(n for n in names if n.endswith("/hpcdist/join/0"))
base = seat[: -len("join/0")]  # hpcdist/<launch>[/<nonce>]/hpcdist/
store.set(base + "failed", "rank 1 on n9: carol says stop")
store.set(base + "hosts", '["evil"]')
store.set(base + "join/1", "evil")
print(json.dumps(names), flush=True)
