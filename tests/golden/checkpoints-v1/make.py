"""Checkpoints of format 1 (hpcdist before format 2: bare sha256 digests, DCP's pickles for values),
kept to show that they still load. Made once with that hpcdist, in an empty folder:

    cd $(mktemp -d) && PYTHONPATH=<checkout of hpcdist at e6dd022> python .../make.py
    tar czf tests/golden/checkpoints-v1.tar.gz plain sharded pickled

- ``plain/``: an unsharded checkpoint (step 1): float32, bfloat16, an attribute;
- ``sharded/``: a sharded one (step 2) whose values (a sampler's position, a tuple with None) are pickles;
- ``pickled/``: a sharded one (step 3) whose value is a pickle that would run ``os.system`` on a full
  unpickle (``touch hpcdist-was-run``): hpcdist must refuse it and run nothing.
"""

import os
import warnings

import torch

from hpcdist.store import CheckpointStore
from hpcdist.store.sharded import checkpoint as sharded


class Runs:
    def __reduce__(self):  # what a colleague's checkpoint may hold: a call made at load
        return (os.system, ("touch hpcdist-was-run",))


warnings.simplefilter("ignore")
w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
half = (torch.arange(6, dtype=torch.float32) / 3).to(torch.bfloat16)
CheckpointStore("plain").save(1, {"net": {"w": w, "half": half, "lr": 0.5}})
sharded.save("sharded", 2, {"w": w, "half": half, "sampler": {"position": 7}, "rng": (1, 2, None)})
sharded.save("pickled", 3, {"w": w, "extra": Runs()})
