"""A deterministic check-then-read race, for tests/test_shared_site_trust.py: first on PYTHONPATH,
it wraps hpcdist's trust check so that, right after the check of the first file whose name ends
with ``$HPCDIST_TEST_SWAP`` passes and before a byte is read, this process tells the test (the
FIFO ``$HPCDIST_TEST_SWAP_GO``) and waits for its answer (``$HPCDIST_TEST_SWAP_DONE``): the
test swaps the file in between, as an attacker timing it with inotify would."""

from __future__ import annotations

import os

SUFFIX = os.environ.get("HPCDIST_TEST_SWAP", "")

if SUFFIX:
    from contextlib import contextmanager
    from typing import Any

    from hpcdist.files import trust

    fired: list[str] = []

    def _handshake(path: object) -> None:
        if fired or not str(path).endswith(SUFFIX):
            return
        fired.append(str(path))
        with open(os.environ["HPCDIST_TEST_SWAP_GO"], "w") as go:
            go.write(str(path))
        with open(os.environ["HPCDIST_TEST_SWAP_DONE"]) as done:
            done.read()

    if hasattr(trust, "opened_trusted"):  # the check is the open: swap between it and the read
        checked_open = trust.opened_trusted

        @contextmanager
        def _opened(path: Any, *args: Any, **kwargs: Any) -> Any:
            with checked_open(path, *args, **kwargs) as opened:
                _handshake(path)
                yield opened

        trust.opened_trusted = _opened
    else:  # a build that checks the path, then opens it again
        check = trust.trusted

        def _trusted(path: Any, *args: Any, **kwargs: Any) -> None:
            check(path, *args, **kwargs)
            _handshake(path)

        trust.trusted = _trusted
