"""A deterministic list-then-copy race, for tests/test_shared_site_paths.py: first on PYTHONPATH, it
wraps the code snapshot's listing so that, once the listing that ``snapshot.make`` copies from is
done and before a byte is copied, this process tells the test (the FIFO
``$HPCDIST_TEST_SNAPSHOT_GO``) and waits for its answer (``$HPCDIST_TEST_SNAPSHOT_DONE``): the test
swaps a listed file for a link in between, as an attacker timing it with inotify would."""

from __future__ import annotations

import os
import sys

if os.environ.get("HPCDIST_TEST_SNAPSHOT_GO"):
    from typing import Any

    from hpcdist.kinds import snapshot

    listing = snapshot.files
    fired: list[bool] = []

    def _files(*args: Any, **kwargs: Any) -> Any:
        listed = listing(*args, **kwargs)
        if not fired and sys._getframe(1).f_code.co_name == "make":
            fired.append(True)
            with open(os.environ["HPCDIST_TEST_SNAPSHOT_GO"], "w") as go:
                go.write(str(args[0]))
            with open(os.environ["HPCDIST_TEST_SNAPSHOT_DONE"]) as done:
                done.read()
        return listed

    snapshot.files = _files
