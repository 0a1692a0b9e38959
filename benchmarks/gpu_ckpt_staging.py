"""On a GPU: a background save's copy of CUDA tensors is one copy into pinned, reused host buffers
(``snapshot.snapshot``, ``sharded.Stager``), bit for bit, and how fast against a pageable ``.cpu()``.

A row of ``make gpu-check``, which runs it as a user's script on the local site and judges the
report it writes (``gpu_judges.judge_staging``):

    hpcdist submit --site local --set resources.gpus_per_node=1 --wait \\
        -- benchmarks/gpu_ckpt_staging.py --json staging.json

or by itself: ``PYTHONPATH=. python benchmarks/gpu_ckpt_staging.py``. It prints one line per part
and exits 1 when a part's check is false. ``--device cpu`` runs the same steps on CPU tensors (no
pinning there, so its report says not pinned): how the tests exercise it without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcdist.model.checkpoint import model_tree
from hpcdist.store import CheckpointStore, read
from hpcdist.store.checkpoint.staging import snapshot
from hpcdist.store.sharded import checkpoint as sharded

# the checks of the report, each a bool; gpu_check's row fails on any that is not True
CHECKS = ("model_tree_kept_on_device", "snapshot_pinned", "snapshot_equal", "buffers_reused",
          "background_save_equal", "stager_pinned", "stager_equal")


def _host(value: Any) -> torch.Tensor:
    """A leaf as the store keeps or reads it (a NumPy array, or a CPU tensor of a dtype NumPy lacks), as a tensor."""
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))


def _pinned(values: Mapping[str, Any], keys: list[str]) -> bool:
    """Every named leaf is a pinned host tensor (a NumPy array, or any unpinned copy, is not)."""
    return all(isinstance(values[k], torch.Tensor) and values[k].is_pinned() for k in keys)


def _equal(values: Mapping[str, Any], sd: Mapping[str, torch.Tensor]) -> bool:
    """Every leaf holds the bits of the state dict's tensor, in its dtype."""
    host = {k: _host(values[k]) for k in sd}
    return all(host[k].dtype == sd[k].dtype and torch.equal(host[k].reshape(-1), sd[k].reshape(-1).cpu()) for k in sd)


def measure(device: str = "cuda", size_mb: float = 1024.0, repeat: int = 5) -> dict[str, Any]:
    """Snapshot, background save and Stager of a state dict of `size_mb` (16 float32 matrices and a
    bfloat16 one) on `device`: each check as a bool and the timings."""
    torch.manual_seed(0)
    side = max(16, int((size_mb * 2**20 / 16 / 4) ** 0.5))
    sd = {f"l{i}.weight": torch.randn(side, side, device=device) for i in range(16)}
    sd["half"] = torch.randn(side // 4, side // 4, device=device).to(torch.bfloat16)
    keys = list(sd)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out: dict[str, Any] = {"device": device, "bytes": nbytes}

    tree = {"model": model_tree(sd)}
    out["model_tree_kept_on_device"] = all(
        isinstance(tree["model"][k], torch.Tensor) and tree["model"][k].device == sd[k].device for k in keys)
    first = snapshot(tree)
    out["snapshot_pinned"] = _pinned(first["model"], keys)
    for v in sd.values():
        v.add_(1)  # a later step: the next snapshot must carry these values into the same buffers
    tree = {"model": model_tree(sd)}
    sync()
    times = []
    again: dict[str, Any] = {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        again = snapshot(tree, reuse=first)
        times.append(time.perf_counter() - t0)
    out["buffers_reused"] = all(again["model"][k] is first["model"][k] for k in keys)
    out["snapshot_equal"] = _equal(again["model"], sd)
    out["snapshot_ms"] = min(times) * 1e3
    t0 = time.perf_counter()
    [v.cpu() for v in sd.values()]
    sync()
    out["pageable_ms"] = (time.perf_counter() - t0) * 1e3

    with tempfile.TemporaryDirectory(prefix="gpu-ckpt-staging-") as tmp:
        store = CheckpointStore(Path(tmp))
        store.save_async(1, {"model": model_tree(sd)})
        store.wait()
        back = read(store.path(1)).tree["model"]
        out["background_save_equal"] = _equal(back, sd)

    stager = sharded.Stager()
    staged = stager.stage({"model": sd})["model"]
    out["stager_pinned"] = _pinned(staged, keys)
    out["stager_equal"] = _equal(staged, sd)
    t0 = time.perf_counter()
    stager.stage({"model": sd})
    out["restage_ms"] = (time.perf_counter() - t0) * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the report here as JSON")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size-mb", type=float, default=1024.0)
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_ckpt_staging: no GPU (torch.cuda.is_available() is false)")
        return 2
    r = measure(args.device, args.size_mb)
    gb = r["bytes"] / 1e9
    print(f"snapshot into reused buffers: {r['snapshot_ms']:.1f} ms for {gb:.2f} GB = "
          f"{gb / r['snapshot_ms'] * 1e3:.1f} GB/s (pinned: {r['snapshot_pinned']}, reused: {r['buffers_reused']}, "
          f"bit-identical: {r['snapshot_equal']}); pageable .cpu() per tensor: {r['pageable_ms']:.1f} ms = "
          f"{gb / r['pageable_ms'] * 1e3:.1f} GB/s")
    print(f"background save of {args.device} state reads back equal: {r['background_save_equal']}")
    print(f"sharded Stager pinned: {r['stager_pinned']}, equal: {r['stager_equal']}, "
          f"re-stage {r['restage_ms']:.1f} ms")
    if args.json is not None:
        args.json.write_text(json.dumps(r, indent=1))
    return 0 if all(r[k] is True for k in CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())
