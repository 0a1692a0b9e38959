"""Large host buffers that are cheap to fill the first time: anonymous memory advised for
transparent huge pages.

Filling freshly allocated memory faults every 4 KiB page in; in a virtual machine each fault is
expensive (on the 2-core build machine, 100 MB of new pages cost ~0.2-0.3 s to touch, 5-8x the
copy itself). With ``MADV_HUGEPAGE`` the kernel backs the buffer with 2 MiB pages where it can
(``transparent_hugepage`` set to ``madvise`` or ``always``), 512x fewer faults. Readers that
receive or read a large state (a checkpoint read, a weight broadcast) take views of one such
buffer instead of allocating per tensor. Where the advice is not available the buffer is an
ordinary one.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_MIN_BYTES = 4 << 20  # below this an ordinary allocation is as cheap
ALIGN = 64  # byte alignment of views, so any dtype can view its part


def empty_bytes(nbytes: int) -> np.ndarray:
    """A new writable uint8 array of `nbytes` (contents undefined), huge-page advised when large."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_MIN_BYTES or advice is None:
        return np.empty(nbytes, dtype=np.uint8)
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return np.empty(nbytes, dtype=np.uint8)
    try:
        m.madvise(advice)
    except OSError:
        pass  # huge pages not configured: still a working buffer
    return np.frombuffer(m, dtype=np.uint8)  # the array keeps the mapping alive


def aligned(offset: int) -> int:
    """`offset` rounded up to the next multiple of ALIGN."""
    return -(-offset // ALIGN) * ALIGN
