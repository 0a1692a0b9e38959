"""Training state <-> checkpoint trees: optimizer, scheduler, scaler, sampler and RNG states.

The optimizer's per-parameter state is stored under the parameter's *name*, not its index, so
a checkpoint reads the same whatever order the parameters were grouped in.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from hpcdist.errors import CheckpointError
from hpcdist.store.checkpoint.tree import Tree, as_tensor


def _names_by_index(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for group in opt.param_groups for p in group["params"]]


def optimizer_tree(model: nn.Module, opt: torch.optim.Optimizer) -> Tree:
    sd = opt.state_dict()
    names = _names_by_index(model, opt)
    groups = []
    for group in sd["param_groups"]:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = [names[i] for i in group["params"]]
        groups.append(g)
    state: Tree = {}
    for idx, entry in sd["state"].items():
        state[names[idx]] = {k: (v if torch.is_tensor(v) else torch.tensor(v)) for k, v in entry.items()}
    return {"param_groups_json": json.dumps(groups), "state": state}


def load_optimizer(model: nn.Module, opt: torch.optim.Optimizer, tree: Tree) -> None:
    names = _names_by_index(model, opt)
    index = {n: i for i, n in enumerate(names)}
    groups = json.loads(tree["param_groups_json"])
    try:
        for g in groups:
            g["params"] = [index[n] for n in g["params"]]
    except KeyError as exc:
        raise CheckpointError(f"optimizer state names parameter {exc} that the model does not have") from None
    state = {
        index[name]: {k: as_tensor(v) for k, v in entry.items() if hasattr(v, "shape")}  # bf16 comes as a tensor
        for name, entry in tree.get("state", {}).items()
    }
    opt.load_state_dict({"state": state, "param_groups": groups})


def json_state(obj: Any) -> Tree:
    return {"state_json": json.dumps(obj.state_dict())}


def load_json_state(obj: Any, tree: Tree) -> None:
    obj.load_state_dict(json.loads(tree["state_json"]))


def rebase_schedule(sched: Any, peak: float) -> None:
    """This run's schedule over a restored one: the peak of this run's ``lr_scaling`` (the
    checkpoint's base lrs are the peak of the world size that wrote it), and the lr of the
    next step from it, as ``LambdaLR`` computes it (the same float when nothing changed)."""
    sched.base_lrs = [peak] * len(sched.base_lrs)
    for group, factor in zip(sched.optimizer.param_groups, sched.lr_lambdas, strict=True):
        group["initial_lr"] = peak
        group["lr"] = peak * factor(sched.last_epoch)
    sched._last_lr = [group["lr"] for group in sched.optimizer.param_groups]


def rng_tree(device: torch.device) -> Tree:
    """Every generator this rank may draw from."""
    np_state: Any = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    out: Tree = {
        "torch_cpu": torch.get_rng_state(),
        "numpy_keys": np.asarray(np_state[1], dtype=np.uint32),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_cached_gaussian": float(np_state[4]),
        "python_state": np.asarray(py_internal, dtype=np.int64),
        "python_version": int(py_version),
        "python_gauss_next": "" if py_gauss is None else repr(py_gauss),
    }
    if device.type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(device)
    return out


def load_rng(tree: Tree, device: torch.device) -> None:
    torch.set_rng_state(torch.from_numpy(np.array(tree["torch_cpu"], dtype=np.uint8)))
    if device.type == "cuda" and "torch_cuda" in tree:
        torch.cuda.set_rng_state(torch.from_numpy(np.array(tree["torch_cuda"], dtype=np.uint8)), device)
    np.random.set_state(
        (
            "MT19937",
            np.array(tree["numpy_keys"], dtype=np.uint32),
            int(tree["numpy_pos"]),
            int(tree["numpy_has_gauss"]),
            float(tree["numpy_cached_gaussian"]),
        )
    )
    gauss = tree["python_gauss_next"]
    random.setstate(
        (int(tree["python_version"]), tuple(int(x) for x in tree["python_state"]), float(gauss) if gauss else None)
    )
