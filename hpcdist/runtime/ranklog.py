"""The rank's log lines: ``<time> [rank R/W host] LEVEL message`` on stderr, for hpcdist's own
logger (``hpcdist``, set up by the bootstrap) and the user's (``hpcdist.user``, by
``hpcdist.init()``); ``HPCDIST_LOG_LEVEL`` sets the level."""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcdist.runtime.rankinfo import RankInfo


def rank_logger(name: str, info: RankInfo, env: Mapping[str, str], replace: bool = True) -> logging.Logger:
    """Logger `name` writing this rank's lines to stderr; its handlers replaced (`replace`), or
    left as they are when it has some already."""
    log = logging.getLogger(name)
    if log.handlers and not replace:
        return log
    for handler in list(log.handlers):
        log.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    host = info.hostname or socket.gethostname()
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s [rank {info.rank}/{info.world_size} {host}] %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(env.get("HPCDIST_LOG_LEVEL", "INFO"))
    log.propagate = False
    return log
