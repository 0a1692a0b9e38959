"""Which files of a folder any process opens, seen from this machine: Linux's inotify (IN_OPEN),
through ctypes. The test cluster's nodes share this machine's file system, so a rank's open on
any node shows here, whoever opened it and however (h5py's C library included)."""

from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
import time
from pathlib import Path

IN_OPEN = 0x20
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


class Opens:
    """The names opened in `folder` (not below it) since the watch began, in order, each with the
    time it was seen (``time.time()``, within 0.1 s)."""

    def __init__(self, folder: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(folder), IN_OPEN) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {folder}")
        self.names: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if not select.select([self.fd], [], [], 0.1)[0]:
                continue
            data = os.read(self.fd, 1 << 16)
            now = time.time()
            at = 0
            while at < len(data):
                _, _, _, size = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size:at + _EVENT.size + size].rstrip(b"\0")
                self.names.append((now, os.fsdecode(name)))
                at += _EVENT.size + size

    def close(self) -> list[tuple[float, str]]:
        """Stop watching; every name opened, with when."""
        self._stop.set()
        self._thread.join()
        os.close(self.fd)
        return self.names
