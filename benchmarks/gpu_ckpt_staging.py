"""On a GPU: a background save's copy of CUDA tensors is one copy into pinned, reused host buffers
(``rawio.snapshot``, ``sharded.Stager``), bit for bit, and how fast against a pageable ``.cpu()``.

Not yet run on a GPU (written where none was at hand); for ``make gpu-check``:

    PYTHONPATH=. python benchmarks/gpu_ckpt_staging.py
"""
# ruff: noqa: E501
import tempfile
import time
import warnings
from pathlib import Path

import torch

from hpcdist.model.checkpoint import model_tree
from hpcdist.store import CheckpointStore, read, sharded
from hpcdist.store.rawio import snapshot

warnings.simplefilter("ignore")

assert torch.cuda.is_available(), "no GPU"
torch.manual_seed(0)
sd = {f"l{i}.weight": torch.randn(4096, 4096, device="cuda") for i in range(16)}  # 1 GiB fp32
sd["half"] = torch.randn(1024, 1024, device="cuda").to(torch.bfloat16)
nbytes = sum(t.numel() * t.element_size() for t in sd.values())
tree = {"model": model_tree(sd)}
assert all(v.is_cuda for v in tree["model"].values() if hasattr(v, "is_cuda")), "model_tree copied to host"
first = snapshot(tree)
assert all(v.is_pinned() for v in first["model"].values() if hasattr(v, "is_pinned")), "not pinned"
for v in sd.values():
    v.add_(1)
tree = {"model": model_tree(sd)}
torch.cuda.synchronize()
times = []
for _ in range(5):
    t0 = time.perf_counter()
    again = snapshot(tree, reuse=first)
    times.append(time.perf_counter() - t0)
assert all(again["model"][k] is first["model"][k] for k in sd), "buffers not reused"
ok = all(torch.equal(again["model"][k].view(-1), sd[k].cpu().view(-1)) for k in sd)
t0 = time.perf_counter()
copies = [v.cpu() for v in sd.values()]
torch.cuda.synchronize()
pageable = time.perf_counter() - t0
print(f"snapshot into pinned reused buffers: {min(times)*1e3:.1f} ms for {nbytes/1e9:.2f} GB = {nbytes/1e9/min(times):.1f} GB/s; "
      f"pageable .cpu() per tensor: {pageable*1e3:.1f} ms = {nbytes/1e9/pageable:.1f} GB/s; bit-identical: {ok}")
d = Path(tempfile.mkdtemp())
store = CheckpointStore(d)
store.save_async(1, {"model": model_tree(sd)})
store.wait()
back = read(store.path(1)).tree["model"]
print("background save of CUDA state reads back equal:", all(torch.equal(torch.as_tensor(back[k]).view(-1).cpu(), sd[k].cpu().view(-1)) if k != "half" else torch.equal(back[k], sd[k].cpu()) for k in sd))
st = sharded.Stager()
staged = st.stage({"model": sd})
print("sharded Stager pinned:", all(v.is_pinned() for v in staged["model"].values()),
      "equal:", all(torch.equal(staged["model"][k], sd[k].cpu()) for k in sd))
t0 = time.perf_counter()
st.stage({"model": sd})
print(f"Stager re-stage: {(time.perf_counter() - t0) * 1e3:.1f} ms")
