"""Another user on the node, played by rank 1: it reaches the job's store port and sets the keys
it can predict (the failure key that stops every rank, the host table); rank 0 prints the address
its store listens on. Every rank then waits past two watchdog polls and exits 0."""

import datetime
import os
import time

import torch.distributed as dist

from hpcdist.runtime.group import rendezvous_key
from hpcdist.runtime.rankinfo import RankInfo

port = int(os.environ["MASTER_PORT"])
if os.environ["RANK"] == "0":
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, _, hexport = local.partition(":")
            if state == "0A" and int(hexport, 16) == port:
                listening.add(addr)
    print(f"store listens on {sorted(listening)}", flush=True)
if os.environ["RANK"] == "1":
    # the launch's own variables, without the torchrun ones hpcdist set for the script
    launch = {k: v for k, v in os.environ.items()
              if not k.startswith(("TORCHELASTIC_", "ROLE_", "GROUP_", "MASTER_", "LOCAL_", "RANK", "WORLD_", "NODE_"))}
    key = rendezvous_key(launch, RankInfo.from_env(launch))
    intruder = dist.TCPStore(os.environ["MASTER_ADDR"], port, None, False, datetime.timedelta(seconds=10))
    intruder.set(f"hpcdist/{key}/hpcdist/failed", "an intruder says stop")
    intruder.set(f"hpcdist/{key}/hpcdist/hosts", '["evil"]')
    print(f"intruder set its keys under hpcdist/{key}/", flush=True)
time.sleep(2.0)
print("still running", flush=True)
