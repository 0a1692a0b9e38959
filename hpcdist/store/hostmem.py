"""Large host arrays on ordinary 4 KiB pages: the memory a checkpoint is read into or copied to.

NumPy advises transparent huge pages for every allocation of 4 MiB or more. On the 2-core build
machine (a Firecracker VM whose balloon takes back free 8 MiB blocks, ``page_reporting_order=11``)
a new 2 MiB page is almost always one the host took back, and zeroing it costs host faults: a
verified read of a 1 GB checkpoint spent 4.4-4.7 s of CPU with huge pages against 1.5-1.7 s on
4 KiB pages (``torch.load``, whose allocator asks for no huge pages, 1.0-1.2 s; three fresh
processes each, load 7-8; ``perf`` put 73 % of the huge-page read in ``clear_page_erms`` under
``do_huge_pmd_anonymous_page``). So these arrays are anonymous mappings advised
``MADV_NOHUGEPAGE``, as torch's tensors get by default; small ones are an ordinary ``np.empty``.

Also the process's resident memory now, and its peak since a mark (``resident_bytes``,
``mark_peak``, ``peak_resident_bytes``), and the node's available memory (``available_bytes``): what
a rank holds after loading or building a model; they see torch's allocations, which ``tracemalloc``
does not. The mark resets Linux's high-water mark (``VmHWM``, by ``/proc/self/clear_refs``), so a
peak reached before it (imports, an earlier model) does not hide the growth after it.
``mark_memory`` and ``peak_memory`` measure the same where a rank's tensors live: CUDA's allocator
for a CUDA device, else the resident memory; and ``release_free_heap`` gives back what a loop of
allocations left on the C heap.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

MAPPED_MIN_BYTES = 4 << 20  # NumPy's threshold for advising huge pages


def empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """A new writable C-ordered array (contents undefined), on 4 KiB pages when large."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if nbytes < MAPPED_MIN_BYTES or advice is None:
        return np.empty(shape, dtype=dtype)
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(advice)
    except (OSError, ValueError):
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(m, dtype=dtype).reshape(shape)  # the array keeps the mapping alive


def resident_bytes() -> int:
    """This process's resident memory now, in bytes (Linux's ``/proc/self/statm``; 0 elsewhere)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def mark_peak() -> int:
    """Reset this process's resident high-water mark to what it holds now (Linux 4.0's
    ``clear_refs`` 5; where that cannot be written the peak stays the process's whole-life one)
    and return that, in bytes: ``peak_resident_bytes() - mark_peak()`` is the growth since."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return resident_bytes()


def _proc_kib(path: str, field: str) -> int | None:
    """`field` of a ``/proc`` file of ``NAME: N kB`` lines, in bytes; None where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes() -> int | None:
    """What this node has free for a new allocation (``MemAvailable``), in bytes; None where unknown."""
    return _proc_kib("/proc/meminfo", "MemAvailable")


def peak_resident_bytes() -> int:
    """This process's peak resident memory since ``mark_peak`` (else since it started), in bytes:
    ``VmHWM`` of ``/proc/self/status``, or ``ru_maxrss`` where there is none."""
    peak = _proc_kib("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing where there
    is none). A loop that frees blocks of a few MB every round keeps them resident otherwise: glibc
    raises its mmap threshold to the size of a block freed, takes the next ones from the heap and
    returns heap memory only from its top. A streamed load of a 203 MB checkpoint at tp=2 in 64 MB
    buckets left each rank holding 79-99 MB for its 51 MB of weights without this, 54-56 MB with it,
    and peaked at 143-164 MB without, 134-154 MB with (`infer_gpt`, 2-core build machine)."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes

        _malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", False)
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None  # glibc's malloc_trim once looked up; False where the C library has none


def mark_memory(device: Any) -> int:
    """What this process holds now where `device` (a ``torch.device``) keeps tensors, with the peak
    reset to it: CUDA's allocator for a CUDA device, else the resident memory (``mark_peak``)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
    return mark_peak()


def peak_memory(device: Any) -> int:
    """The peak since ``mark_memory(device)``, measured as it measured: ``peak_memory(d) -
    mark_memory(d)`` is how much more the process held at most in between."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    return peak_resident_bytes()
