"""Checkpoint write and read throughput: hpcdist's HDF5 checkpoint against `dd ... conv=fsync` of
the same size on the same disk, and against `torch.save` of the same state, in one run; then
the step-time cost of a checkpoint with a synchronous and with a background (`save_async`) save.

Every writer ends durable: hpcdist fsyncs the file and the directory and commits the pointer
(and hashes every array), dd uses conv=fsync, torch.save is followed by an fsync. Reads are
hpcdist's verified read (the digest of every array: XXH3-128 unless HPCDIST_CHECKSUM says
sha256) and torch.load. Medians of --repeat runs; files
are deleted as the run goes (the disk slows down after heavy writing).

    PYTHONPATH=. python benchmarks/train_checkpoint_io.py --dir /var/tmp/hpcdist-bench --size 100
    PYTHONPATH=. python benchmarks/train_checkpoint_io.py --dir /var/tmp/hpcdist-bench --size 1000 --repeat 2
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from hpcdist import store
from hpcdist.files.atomic import fsync_path
from hpcdist.model.checkpoint import model_attrs, model_tree
from hpcdist.model.gpt import GPT, GPTConfig
from hpcdist.store import checksum
from hpcdist.store.checkpoint.tree import flatten
from hpcdist.train import state as st


def training_state(d_model: int, n_layer: int) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, context=256, n_layer=n_layer, n_head=max(1, d_model // 64), d_model=d_model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 257, (2, 16))).float().mean().backward()
    opt.step()  # creates exp_avg / exp_avg_sq: the optimizer state is twice the model
    return model, opt


SIZES = {100: (384, 5), 1000: (1024, 7)}  # MB of model + AdamW state -> (d_model, n_layer): 109 MB, 1.06 GB


def train_step(model: GPT, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(batch).float().mean().backward()
    opt.step()


def step_cost(base: Path, model: GPT, opt: torch.optim.Optimizer, repeat: int) -> None:
    """What a checkpoint costs the training loop: blocked time, and the slowdown of the steps
    that run while a background save writes."""
    batch = torch.randint(0, 257, (4, 64))
    state = lambda: {"model": model_tree(model.state_dict()), "optimizer": st.optimizer_tree(model, opt)}  # noqa: E731
    tensors = [t for t in model.state_dict().values()] + [
        v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    ]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    for _ in range(2):
        train_step(model, opt, batch)
    plain, steps, sync, blocked, during, counts = [], [], [], [], [], []
    store_sync = store.CheckpointStore(base / "sync", keep_last=1)
    store_bg = store.CheckpointStore(base / "async", keep_last=1)
    t0 = time.perf_counter()
    store_bg.save_async(0, state())  # the first save allocates its host copy; later ones reuse it
    first = time.perf_counter() - t0
    store_bg.wait()
    for i in range(repeat):
        t0 = time.perf_counter()
        copies = [t.clone() for t in tensors]
        plain.append(time.perf_counter() - t0)
        del copies
        gc.collect()
        for _ in range(3):
            t0 = time.perf_counter()
            train_step(model, opt, batch)
            steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        store_sync.save(i, state())
        sync.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        store_bg.save_async(i + 1, state())
        blocked.append(time.perf_counter() - t0)
        n = 0
        while store_bg.saving:
            t0 = time.perf_counter()
            train_step(model, opt, batch)
            during.append(time.perf_counter() - t0)
            n += 1
        counts.append(n)
        store_bg.wait()
    med = statistics.median
    step, slow = med(steps), (med(during) if during else med(steps))
    extra = med(counts) * max(0.0, slow - step)
    print(f"# step-time cost of a checkpoint ({nbytes / 1e6:.1f} MB of tensors), medians of {repeat}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"training step without a checkpoint         {step:8.3f} s")
    print(f"synchronous save (blocks the step)         {med(sync):8.3f} s")
    print(f"save_async: blocked (copy to host memory)  {med(blocked):8.3f} s   "
          f"vs plain copy {med(plain):.3f} s: {med(blocked) / med(plain):.2f}x (first save, allocating: "
          f"{first:.3f} s)")
    print(f"save_async: steps while writing            {med(counts):8.0f}     at {slow:.3f} s/step "
          f"(+{slow - step:.3f} s each)")
    print(f"cost of one checkpoint: synchronous {med(sync):.3f} s, background {med(blocked) + extra:.3f} s "
          f"({(med(blocked) + extra) / med(sync):.2f}x)")


class Bench:
    """One measurement each, appended to `rows` in MB/s, and the CPU time it took to `cpu` in s
    (every thread of this process, or dd's own), so a run shows where the time went."""

    def __init__(
        self, base: Path, tree: dict, torch_state: dict, attrs: dict,
        rows: dict[str, list[float]], cpu: dict[str, list[float]],
    ) -> None:
        self.base, self.tree, self.torch_state, self.attrs = base, tree, torch_state, attrs
        self.rows, self.cpu = rows, cpu

    def hdf5_write(self, i: int) -> int:
        c0 = time.process_time()
        stats = store.save(self.base / "h5", i, self.tree, attrs=self.attrs)
        self.cpu["hdf5_write"].append(time.process_time() - c0)
        store.CheckpointStore(self.base / "h5", keep_last=1).prune()  # outside the time, as in `save`
        self.rows["hdf5_write"].append(stats.bytes / 1e6 / stats.seconds)
        return stats.bytes

    def dd_write(self, size: int) -> None:
        mib = max(1, round(size / 2**20))
        seconds, cpu = time_dd(self.base / "dd.bin", mib)
        self.rows["dd_write"].append(mib * 2**20 / 1e6 / seconds)
        self.cpu["dd_write"].append(cpu)
        (self.base / "dd.bin").unlink()

    def hdf5_read(self, i: int) -> None:
        c0 = time.process_time()
        loaded = store.read(store.CheckpointStore(self.base / "h5").path(i), verify=True)
        self.cpu["hdf5_read"].append(time.process_time() - c0)
        self.rows["hdf5_read"].append(loaded.mb_per_s)

    def torch_write(self, i: int) -> None:
        path = self.base / f"torch-{i}.pt"
        t0, c0 = time.perf_counter(), time.process_time()
        torch.save(self.torch_state, path)
        fsync_path(path)
        self.cpu["torch_write"].append(time.process_time() - c0)
        self.rows["torch_write"].append(path.stat().st_size / 1e6 / (time.perf_counter() - t0))

    def torch_read(self, i: int) -> None:
        path = self.base / f"torch-{i}.pt"
        t0, c0 = time.perf_counter(), time.process_time()
        torch.load(path, weights_only=True)
        self.cpu["torch_read"].append(time.process_time() - c0)
        self.rows["torch_read"].append(path.stat().st_size / 1e6 / (time.perf_counter() - t0))


def time_dd(path: Path, mib: int) -> tuple[float, float]:
    """dd's own time for `mib` MiB with conv=fsync, and the CPU time it used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "conv=fsync"],
        capture_output=True, text=True, check=True,
    )
    elapsed = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    match = re.search(r"copied, ([\d.]+) s", proc.stderr)
    return (float(match.group(1)) if match else elapsed), cpu


def checksum_alone(tree: dict) -> float:
    """Seconds to hash (the chosen checksum) every array of `tree` on one thread: what a verified write or read
    must spend on top of the bytes (median of 3)."""
    arrays = [a for _, a in flatten(tree)[0]]
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for a in arrays:
            checksum.digest(a)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="a directory on the disk to measure")
    parser.add_argument("--size", type=int, choices=sorted(SIZES), default=100, help="MB of state, about")
    parser.add_argument("--d-model", type=int, default=None, help="instead of --size")
    parser.add_argument("--n-layer", type=int, default=None, help="instead of --size")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-step-cost", action="store_true", help="skip the sync/async step-time part")
    args = parser.parse_args()
    d_model, n_layer = SIZES[args.size]
    args.d_model, args.n_layer = args.d_model or d_model, args.n_layer or n_layer
    Path(args.dir).mkdir(parents=True, exist_ok=True)  # the folder the command names, made if missing
    base = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        model, opt = training_state(args.d_model, args.n_layer)
        tree = {"model": model_tree(model.state_dict()), "optimizer": st.optimizer_tree(model, opt)}
        torch_state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        names = ("hdf5_write", "dd_write", "torch_write", "hdf5_read", "torch_read")
        rows: dict[str, list[float]] = {k: [] for k in names}
        cpu: dict[str, list[float]] = {k: [] for k in names}
        size = Bench(base, tree, torch_state, model_attrs(model.cfg), rows, cpu).hdf5_write(0)  # the size dd writes
        shutil.rmtree(base / "h5")
        rows["hdf5_write"].clear()
        cpu["hdf5_write"].clear()
        for i in range(args.repeat):
            # each file is read right after it is written (this machine keeps little in its page
            # cache: a file written 2 GB earlier is read from disk); the order of the blocks
            # alternates by repeat and every result is freed at once, so that neither reader
            # inherits the other's memory (fresh pages cost much on a VM)
            b = Bench(base, tree, torch_state, model_attrs(model.cfg), rows, cpu)
            blocks = [(b.hdf5_write, b.hdf5_read), (b.dd_write,), (b.torch_write, b.torch_read)]
            for block in (blocks if i % 2 == 0 else blocks[::-1]):
                for run in block:
                    run(size if run == b.dd_write else i)
                    gc.collect()
            (base / f"torch-{i}.pt").unlink()
        med = {k: statistics.median(v) for k, v in rows.items()}
        import h5py

        print(f"# checkpoint of GPT d_model={args.d_model} n_layer={args.n_layer} with AdamW state: "
              f"{size / 1e6:.1f} MB, {args.repeat} repeats, disk of {base}, load average "
              f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, h5py {h5py.__version__}")

        def ratio(key: str, peer: str) -> float:  # per repeat (measured back to back), then the median
            return statistics.median(a / b for a, b in zip(rows[key], rows[peer], strict=True))

        def line(key: str, label: str, peer: str) -> None:
            wall_ms = size / med[key] / 1e3
            print(f"{label:<28}{med[key]:>12.0f}{ratio(key, peer):>10.2f}{wall_ms:>10.0f}"
                  f"{statistics.median(cpu[key]) * 1e3:>10.0f}")

        print(f"{'writer':<28}{'median MB/s':>12}{'vs dd':>10}{'wall ms':>10}{'CPU ms':>10}")
        for key, label in (("dd_write", "dd conv=fsync"), ("hdf5_write", f"hpcdist HDF5 ({checksum.chosen()}+fsync)"),
                           ("torch_write", "torch.save + fsync")):
            line(key, label, "dd_write")
        print(f"{'reader':<28}{'median MB/s':>12}{'vs torch':>10}{'wall ms':>10}{'CPU ms':>10}")
        for key, label in (("torch_read", "torch.load"), ("hdf5_read", "hpcdist HDF5 (verified)")):
            line(key, label, "torch_read")
        print(f"hdf5 write / torch.save = {med['hdf5_write'] / med['torch_write']:.2f}")
        hashing, cores = checksum_alone(tree), os.cpu_count() or 1
        floor = statistics.median(cpu["hdf5_write"]) / cores
        print(f"{checksum.chosen()} of every array on one thread: {hashing * 1e3:.0f} ms; the hpcdist write's CPU time "
              f"spread over all {cores} cores takes at least {floor * 1e3:.0f} ms, dd's wall time "
              f"{size / med['dd_write'] / 1e3:.0f} ms (wall ms: bytes / median MB/s)")
        shutil.rmtree(base / "h5", ignore_errors=True)
        if not args.no_step_cost:
            step_cost(base, model, opt, args.repeat)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
