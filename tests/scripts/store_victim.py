"""alice's job for tests/test_shared_site_store.py: it runs until the test says the forgery is done
(the file named by its first argument appears), then long enough for three polls of the watchdog
that a forged failure key would trigger, and exits 0."""

import sys
import time
from pathlib import Path

go = Path(sys.argv[1])
deadline = time.monotonic() + 90
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.1)
print(f"told to go on: {go.exists()}", flush=True)
time.sleep(1.6)
print("still running", flush=True)
