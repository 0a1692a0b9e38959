"""A tensor-parallel GPT for inference, built from ``hpcdist.model.gpt.GPT``'s weights, for every
family the config expresses (GPT-2, LLaMA, Mistral, Qwen2).

Megatron-style placement (Shoeybi et al. 2019, section 3): in each block the attention's
``c_attn`` is column-parallel (each rank computes its own heads, no communication), ``c_proj`` is
row-parallel (each rank multiplies its heads' slice and an all-reduce sums the partial
outputs, then the bias is added once); the MLP's ``c_fc`` is column-parallel (GELU or SwiGLU
applied locally to its hidden slice) and its ``c_proj`` row-parallel with one all-reduce. So a
block costs two all-reduces of (batch, time, d_model). The head is vocab-parallel: rank r
multiplies by its rows of the tied ``wte`` (or of an untied ``lm_head``) and an all-gather
assembles the logits, so every rank of a group holds identical logits (and samples the same
token from the same seed).

Grouped-query attention: a rank holds its query heads and the KV heads they read, its share of
them when tp divides ``n_kv_head``, else the one they share (replicated on tp / n_kv_head ranks);
the KV cache holds those KV heads only. Rotary embeddings are applied on each rank to its own
heads, from the positions every rank has.

Parameter names equal ``GPT``'s, holding each rank's shard; with ``tp == 1`` no collective runs
and the model is the plain GPT with a KV cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hpcdist.errors import ConfigError
from hpcdist.infer.shard_load import check_tp, kv_heads_per_rank, vocab_rows
from hpcdist.model import rope
from hpcdist.model.config import GPTConfig
from hpcdist.model.gpt import make_norm


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group; `group` is None when tp == 1."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


_DECODE_ROWS = 8  # the row count oneDNN picks its packed layout for; any count works


def _prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` in oneDNN's blocked layout for decode-sized inputs, or None where that does not apply.

    A decode step multiplies a few rows by every weight of the model once, so it is bound by how
    fast the weights stream from memory; through weights packed once at load time the matmuls of a
    step over 42 MB of weights took about a fifth less time than F.linear on the plain ones
    (CPU, float32; other devices and dtypes keep F.linear).
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return cast(torch.Tensor, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _DECODE_ROWS))
    except (AttributeError, RuntimeError):  # a torch build without the op: plain F.linear
        return None


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            packed: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for x (rows, in); through `packed` when given (decode steps only, see `TPGPT._linear`)."""
    if packed is None:
        return F.linear(x, weight, bias)
    return cast(torch.Tensor, torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def weight_bytes(model: nn.Module) -> int:
    """Bytes a model's parameters and buffers hold (this rank's shard of them)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


class ColumnParallelLinear(nn.Linear):
    """y = x A_r^T + b_r: this rank's output slice; the input is the full (replicated) x."""


class RowParallelLinear(nn.Module):
    """y = sum_r x_r A_r^T + b: this rank's input slice, partial products summed by all-reduce."""

    def __init__(self, in_local: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None


class KVCache:
    """Preallocated keys and values per layer, written in place: (2, batch, local KV heads, max_len, d_head).

    Keys and values of a layer share one tensor so a step stores both with one copy.
    """

    def __init__(self, n_layer: int, batch: int, n_head: int, max_len: int, d_head: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        shape = (2, batch, n_head, max_len, d_head)
        self.kv = [torch.empty(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.kv)
        self.length = 0
        self.max_len = max_len


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, -inf elsewhere: the form SDPA adds to the scores as it is."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class TPAttention(nn.Module):
    """Parameters only: `c_attn` column-parallel (this rank's heads), `c_proj` row-parallel."""

    def __init__(self, cfg: GPTConfig, tp: TPGroup) -> None:
        super().__init__()
        q_local = cfg.n_head // tp.size * cfg.d_head
        kv_local = kv_heads_per_rank(cfg, tp.size) * cfg.d_head
        self.c_attn = ColumnParallelLinear(cfg.d_model, q_local + 2 * kv_local, bias=cfg.attention_bias)
        self.c_proj = RowParallelLinear(q_local, cfg.d_model, bias=cfg.attention_out_bias)


class TPMLP(nn.Module):
    """Parameters only: `c_fc` column-parallel (this rank's hidden slice), `c_proj` row-parallel."""

    def __init__(self, cfg: GPTConfig, tp: TPGroup) -> None:
        super().__init__()
        h_local = cfg.d_hidden // tp.size
        self.c_fc = ColumnParallelLinear(cfg.d_model, h_local * (2 if cfg.mlp == "swiglu" else 1), bias=cfg.mlp_bias)
        self.c_proj = RowParallelLinear(h_local, cfg.d_model, bias=cfg.mlp_bias)


class TPBlock(nn.Module):
    """Parameters only; `TPGPT._block` computes the block."""

    def __init__(self, cfg: GPTConfig, tp: TPGroup) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = TPAttention(cfg, tp)
        self.ln_2 = make_norm(cfg)
        self.mlp = TPMLP(cfg, tp)


class _Linear(NamedTuple):
    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor | None


Norm = tuple[torch.Tensor, torch.Tensor | None]  # weight, and bias for a LayerNorm


class _Layer(NamedTuple):
    """One block's tensors, gathered once: a step then does no module calls or attribute lookups."""

    ln_1: Norm
    c_attn: _Linear
    c_proj: _Linear
    ln_2: Norm
    c_fc: _Linear
    mlp_proj: _Linear


def _layer_tensors(block: TPBlock, pack: bool) -> _Layer:
    def lin(m: nn.Module) -> _Linear:
        w, b = cast(torch.Tensor, m.weight), cast("torch.Tensor | None", m.bias)
        return _Linear(w, b, _prepack(w) if pack else None)

    def norm(m: nn.Module) -> Norm:
        return cast(torch.Tensor, m.weight), cast("torch.Tensor | None", getattr(m, "bias", None))

    return _Layer(norm(block.ln_1), lin(block.attn.c_attn), lin(block.attn.c_proj),
                  norm(block.ln_2), lin(block.mlp.c_fc), lin(block.mlp.c_proj))


class TPGPT(nn.Module):
    """One rank's shard of a GPT; call `load_shard` with that rank's tensors before use."""

    def __init__(self, cfg: GPTConfig, tp: TPGroup | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        tp = tp or TPGroup()
        problems = check_tp(cfg, tp.size)
        if problems:
            what, value, todo = problems[0]
            raise ConfigError(f"{what}={value} {todo}")
        self.cfg, self.tp = cfg, tp
        self.vocab_local = -(-cfg.vocab_size // tp.size)  # padded so every rank gathers equal slices
        with torch.device(device), _default_dtype(dtype):  # made in `dtype`: never a float32 copy first
            layers: dict[str, nn.Module] = {"wte": nn.Embedding(cfg.vocab_size, cfg.d_model)}
            if cfg.positions == "learned":
                layers["wpe"] = nn.Embedding(cfg.context, cfg.d_model)
            layers["h"] = nn.ModuleList(TPBlock(cfg, tp) for _ in range(cfg.n_layer))
            layers["ln_f"] = make_norm(cfg)
            self.transformer = nn.ModuleDict(layers)
            if not cfg.tied:  # this rank's rows of the untied head
                lo, hi = vocab_rows(cfg, tp.rank, tp.size)
                self.lm_head = nn.Linear(cfg.d_model, hi - lo, bias=False)
            if cfg.positions == "rope":  # float32 whatever the weights: angles lose positions in bf16
                self.register_buffer("inv_freq", rope.inv_freq(cfg).float(), persistent=False)
            # this rank's rows of the tied embedding, stored transposed (d_model, vocab): the head is
            # the largest matmul of a decode step, and the plain (NN) layout runs it faster on CPUs
            self.register_buffer("head_t", torch.zeros(cfg.d_model, self.vocab_local), persistent=False)
        self.requires_grad_(False)
        self.eval()
        self.n_local = cfg.n_head // tp.size
        self.kv_local = kv_heads_per_rank(cfg, tp.size)
        self._layers = self._gather(pack=False)
        self._loaded: set[str] = set()  # the tensors `load_shard` copied in so far

    @property
    def wte(self) -> nn.Embedding:
        return cast(nn.Embedding, self.transformer["wte"])

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    @torch.no_grad()
    def load_shard(self, state: dict[str, Any], last: bool = True) -> None:
        """Copy this rank's tensors (names as in ``GPT.state_dict()``, shapes of this shard) in; a
        streamed load passes a few at a time with `last` False, then `last` True to finish."""
        own = self.state_dict()
        for key in (k for k in own if k in state):
            value, param = torch.as_tensor(state[key]), own[key]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{key}: shard has shape {tuple(value.shape)}, this rank expects {tuple(param.shape)}")
            param.copy_(value)
            self._loaded.add(key)
        if not last:
            return
        missing = sorted(set(own) - self._loaded)
        if missing:
            raise KeyError(f"shard lacks {missing[:3]}")
        if self.cfg.tied:
            v0 = self.tp.rank * self.vocab_local
            rows = self.wte.weight[v0 : v0 + self.vocab_local]
        else:
            rows = self.lm_head.weight
        head_t = cast(torch.Tensor, self.head_t)
        head_t.zero_()
        head_t[:, : rows.shape[0]] = rows.t()
        self._layers = self._gather(pack=True)

    def _gather(self, pack: bool) -> list[_Layer]:
        return [_layer_tensors(cast(TPBlock, block), pack) for block in cast(nn.ModuleList, self.transformer["h"])]

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.wte.weight
        return KVCache(self.cfg.n_layer, batch, self.kv_local, max_len, self.cfg.d_head, p.device, p.dtype)

    @torch.no_grad()
    def forward(
        self,
        idx: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        real: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (batch, time, vocab) for `idx` (batch, time); (batch, 1, vocab) with `last_only`.

        `positions` (batch, time) default to 0..t-1 after the cached tokens; `mask` (batch, 1,
        time, cached + time) is a boolean attention mask (True = attend) or an ``additive_mask``
        (what a generation loop builds once and slices per step), default causal; with
        `cache`, keys and values are appended to it and its length advanced. `last_only` computes
        the head for the last position only, which is all generation needs: for a prefill of T
        tokens the head (d_model x vocab per position) would otherwise cost T times one step.
        `real` (batch, time), False at a left-padding position, lets a prefill skip the padding in
        every linear layer (a third of a typical ragged batch); padding keys and values are then
        zeros, which `mask` must hide from the real positions.
        """
        b, t = idx.shape
        past = cache.length if cache is not None else 0
        why = self.cfg.check_length(past + t)
        if why is not None:
            raise ConfigError(f"a sequence of {why}")
        if positions is None:
            positions = torch.arange(past, past + t, device=idx.device).expand(b, t)
        if mask is None and past and t > 1:
            causal = torch.ones(t, past + t, dtype=torch.bool, device=idx.device).tril(past)
            mask = causal.expand(b, 1, t, past + t)
        if mask is not None and mask.dtype == torch.bool:  # converted once here, not by every layer's SDPA
            mask = additive_mask(mask, self.wte.weight.dtype)
        d = self.cfg.d_model
        x = self.wte(idx)
        rot = None
        if self.cfg.positions == "learned":
            x = x + self.transformer["wpe"](positions)
        else:
            rot = rope.cos_sin(cast(torch.Tensor, self.inv_freq), positions, x.dtype)
        x = x.view(b * t, d)
        decode = t == 1
        rows = None if real is None or decode else real.reshape(-1).nonzero().squeeze(1)
        if rows is not None:
            x = x.index_select(0, rows)
        for layer, weights in enumerate(self._layers):
            x = self._block(x, weights, b, t, mask, cache, layer, decode, rows, rot)
        if rows is not None:
            x = x.new_zeros(b * t, d).index_copy_(0, rows, x)
        if cache is not None:
            cache.length = past + t
        x = x.view(b, t, d)
        if last_only:
            x = x[:, -1:]
        x = self.transformer["ln_f"](x)
        logits = self.tp.all_gather_last(x @ cast(torch.Tensor, self.head_t))
        return logits[..., : self.cfg.vocab_size]

    def _linear(self, x: torch.Tensor, lin: _Linear, decode: bool, row: bool) -> torch.Tensor:
        """A column- or row-parallel (`row`) linear of `x` (rows, in); packed weights for a decode step.

        Longer inputs (prefill, a full forward) are compute-bound, where MKL on the plain weight is
        faster; they also keep the tp=1 forward bit-identical to ``GPT``'s.
        """
        packed = lin.packed if decode else None
        if not row or self.tp.size == 1:  # no partial sums: the bias joins the product
            return _matmul(x, lin.weight, lin.bias, packed)
        y = self.tp.all_reduce(_matmul(x, lin.weight, None, packed))
        return y if lin.bias is None else y.add_(lin.bias)

    def _norm(self, x: torch.Tensor, w: Norm) -> torch.Tensor:
        if self.cfg.norm == "rmsnorm":
            return torch.rms_norm(x, (self.cfg.d_model,), w[0], self.cfg.ln_eps)
        return torch.layer_norm(x, (self.cfg.d_model,), w[0], w[1], self.cfg.ln_eps)

    def _block(self, x: torch.Tensor, w: _Layer, b: int, t: int, mask: torch.Tensor | None,
               cache: KVCache | None, layer: int, decode: bool, rows: torch.Tensor | None,
               rot: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """One transformer block, Megatron-placed (see the module docstring).

        `x` is (b * t, d_model), or only the `rows` of it that are real tokens: attention then runs
        on the padded (b, t) layout with zeros at the padding.
        """
        cfg = self.cfg
        hd, nq, nkv = cfg.d_head, self.n_local, self.kv_local
        qkv = self._linear(self._norm(x, w.ln_1), w.c_attn, decode, row=False)
        if rows is not None:
            qkv = qkv.new_zeros(b * t, qkv.shape[1]).index_copy_(0, rows, qkv)
        qkv = qkv.view(b, t, nq + 2 * nkv, hd)
        q = qkv[:, :, :nq].transpose(1, 2)  # (b, local heads, t, d_head)
        k, v = qkv[:, :, nq : nq + nkv].transpose(1, 2), qkv[:, :, nq + nkv :].transpose(1, 2)
        if rot is not None:
            q, k = rope.rotate(q, *rot), rope.rotate(k, *rot)
        if cache is not None:
            start, kv = cache.length, cache.kv[layer]
            if rot is None:
                kv[:, :, :, start : start + t] = qkv[:, :, nq:].view(b, t, 2, nkv, hd).permute(2, 0, 3, 1, 4)
            else:
                kv[0, :, :, start : start + t] = k
                kv[1, :, :, start : start + t] = v
            k, v = kv[0, :, :, : start + t], kv[1, :, :, : start + t]
        gqa = nkv != nq
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(b * t, -1)
        if rows is not None:
            y = y.index_select(0, rows)
        x = self._linear(y, w.c_proj, decode, row=True).add_(x)
        h = self._linear(self._norm(x, w.ln_2), w.c_fc, decode, row=False)
        if cfg.mlp == "swiglu":
            gate, up = h.chunk(2, dim=-1)  # this rank's gate slice, then the same slice of up
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self._linear(h, w.mlp_proj, decode, row=True).add_(x)
