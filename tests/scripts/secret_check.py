"""Whether HF_TOKEN reached this rank, checked by its digest (the value is never printed).

Rank 0 writes a result file (whose bytes the test searches for the value); a rank that did
not get the token exits 3.
"""

import hashlib
import os
import sys

import hpcdist

ctx = hpcdist.init()
seen = hashlib.sha256(os.environ.get("HF_TOKEN", "").encode()).hexdigest() == os.environ["EXPECTED_DIGEST"]
print(f"rank {ctx.rank}: token seen {seen}", flush=True)
ctx.results.attrs.update(token_seen=int(seen))
ctx.close()
sys.exit(0 if seen else 3)
