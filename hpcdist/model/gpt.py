"""A decoder-only transformer language model, GPT-2 or LLaMA-shaped (``GPTConfig``), sized from a job spec.

Parameter names follow Hugging Face's GPT-2 (``transformer.h.0.attn.c_attn.weight`` ...) for every
family, so one checkpoint layout, one tensor-parallel split and one loader serve them all:
``c_attn`` holds q, then k, then v (``n_kv_head`` heads each for k and v), ``mlp.c_fc`` holds the
gate, then the up projection for SwiGLU. ``hpcdist.model.hf`` maps these onto GPT-2 (Conv1D
weights transposed) and onto LLaMA, Mistral and Qwen2 (q/k/v and gate/up split apart). The head
is tied to the token embedding unless ``tied`` is false.

Each parameter's initial values come from a generator of its own, seeded by the model's seed and
the parameter's name (``initial_value``): a model built on the meta device and sharded (FSDP2)
gets each rank's part of exactly the weights the whole model would have, one parameter at a time.

On GPUs the head multiplies by a vocabulary padded to a multiple of ``VOCAB_MULTIPLE`` (GPT-2's
50257 -> 50304, what tensor cores tile well), zero rows added to the weight for the matmul only
(on CPUs, where the extra copy costs more than the alignment gives, it does not pad): the
parameters, their state dict, checkpoints and exports keep the real vocabulary, and the logits are
cut back to it, so the padded rows reach neither the loss nor sampling. ``compile_parts`` compiles
each block and the head with its loss (torchtitan's per-block ``torch.compile``), the modules DDP and
FSDP2 wrap staying eager, so their hooks still run per block.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hpcdist.errors import ConfigError
from hpcdist.model import rope
from hpcdist.model.config import GPTConfig

__all__ = ["GPTConfig", "GPT", "make_norm", "padded_vocab", "head_logits", "head_loss"]

VOCAB_MULTIPLE = 64  # the head's matmul width is padded to a multiple of this


def padded_vocab(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The vocabulary the head multiplies by: `vocab_size` rounded up to `multiple` (50257 -> 50304)."""
    return -(-vocab_size // multiple) * multiple


def head_logits(x: torch.Tensor, weight: torch.Tensor, vocab_size: int, multiple: int = 1) -> torch.Tensor:
    """Logits over the real vocabulary (a view of the padded matmul's output, no copy): `weight`
    (vocab_size, d) gets zero rows up to ``padded_vocab(vocab_size, multiple)`` for the matmul only."""
    pad = padded_vocab(vocab_size, multiple) - weight.shape[0]
    if pad > 0:
        weight = F.pad(weight, (0, 0, 0, pad))
    return F.linear(x, weight)[..., :vocab_size]


def head_loss(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, multiple: int = 1
) -> torch.Tensor:
    """The mean next-token cross entropy, in float32, over the real vocabulary."""
    logits = head_logits(x, weight, vocab_size, multiple)
    return F.cross_entropy(logits.float().reshape(-1, vocab_size), targets.reshape(-1))


def make_norm(cfg: GPTConfig) -> nn.Module:
    """The block's and the final norm: LayerNorm (GPT-2) or RMSNorm (LLaMA), weight named ``weight``."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.d_head = cfg.n_head, cfg.n_kv, cfg.d_head
        q, kv = cfg.n_head * cfg.d_head, cfg.n_kv * cfg.d_head
        self.sizes = (q, kv, kv)
        self.c_attn = nn.Linear(cfg.d_model, q + 2 * kv, bias=cfg.attention_bias)
        self.c_proj = nn.Linear(q, cfg.d_model, bias=cfg.attention_out_bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(self.sizes, dim=2)
        q = q.view(b, t, self.n_head, self.d_head).transpose(1, 2)
        k, v = (z.view(b, t, self.n_kv, self.d_head).transpose(1, 2) for z in (k, v))
        if rot is not None:
            q, k = rope.rotate(q, *rot), rope.rotate(k, *rot)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv != self.n_head,
        )
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.kind = cfg.mlp
        width = cfg.d_hidden * (2 if cfg.mlp == "swiglu" else 1)
        self.c_fc = nn.Linear(cfg.d_model, width, bias=cfg.mlp_bias)
        self.c_proj = nn.Linear(cfg.d_hidden, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")  # GPT-2's "gelu_new"
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rot)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # drawn before any module (whose own init draws on the CPU but not on the meta device)
        self.seed = int(torch.randint(2**62, (), device="cpu"))
        layers: dict[str, nn.Module] = {"wte": nn.Embedding(cfg.vocab_size, cfg.d_model)}
        if cfg.positions == "learned":
            layers["wpe"] = nn.Embedding(cfg.context, cfg.d_model)
        layers.update({"drop": nn.Dropout(cfg.dropout), "h": nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                       "ln_f": make_norm(cfg)})
        self.transformer = nn.ModuleDict(layers)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied:
            wte = self.transformer["wte"]
            assert isinstance(wte, nn.Embedding)
            self.lm_head.weight = wte.weight
        if cfg.positions == "rope":
            self.register_buffer("inv_freq", rope.inv_freq(cfg), persistent=False)
        if not self.lm_head.weight.is_meta:  # on the meta device the caller initialises (``init_weights``)
            self.init_weights()
        self._head_loss: Callable[..., torch.Tensor] = head_loss
        self.compiled = False

    def compile_parts(self, **options: object) -> None:
        """``torch.compile`` each block and the head with its loss, in place (before DDP or FSDP2
        wraps the model): the blocks share one compiled graph, and the loss is computed from the
        padded head's output without a float32 copy of the logits in memory."""
        blocks = self.transformer["h"]
        assert isinstance(blocks, nn.ModuleList)
        for block in blocks:
            block.compile(**options)
        self._head_loss = torch.compile(head_loss, **options)  # type: ignore[call-overload]
        self.compiled = True

    def initial_value(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Parameter `name`'s whole initial value, on the CPU: GPT-2's init (normal, std 0.02, the
        residual projections 0.02 / sqrt(2 n_layer); norms one, biases zero) drawn from a
        generator seeded by the model's seed and the name, so it does not depend on the order or
        the device of construction."""
        module = self.get_submodule(name.rpartition(".")[0])
        if name.endswith(".bias") or isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            fill = 0.0 if name.endswith(".bias") else 1.0
            return torch.full(shape, fill, dtype=dtype, device="cpu")
        std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
        g = torch.Generator(device="cpu").manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        return torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=g).to(dtype)

    @torch.no_grad()
    def init_weights(self, write: Callable[[nn.Parameter, torch.Tensor], None] | None = None) -> None:
        """Every parameter's initial value and the buffers, on any device: `write` puts a
        parameter's whole value where it belongs (by default the whole of it; a sharded model's
        writes its rank's part, ``hpcdist.train.parallel.init_shards``), one parameter at a time."""
        for name, p in self.named_parameters():  # a tied head is the embedding, listed once
            whole = self.initial_value(name, tuple(p.shape), p.dtype)
            if write is None:
                p.copy_(whole)
            else:
                write(p, whole)
            del whole
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """The non-persistent buffers (RoPE's frequencies), e.g. after ``to_empty``."""
        if self.cfg.positions == "rope":
            buf = self.get_buffer("inv_freq")
            buf.copy_(rope.inv_freq(self.cfg, "cpu"))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, time, vocab) for token ids (batch, time); with `targets` (batch, time),
        the mean cross entropy instead (float32), the head and loss computed together."""
        b, t = idx.shape
        why = self.cfg.check_length(t)
        if why is not None:
            raise ConfigError(f"a sequence of {why}")
        pos = torch.arange(t, device=idx.device)
        x = self.transformer["wte"](idx)
        rot = None
        if self.cfg.positions == "learned":
            x = x + self.transformer["wpe"](pos)
        else:
            rot = rope.cos_sin(self.get_buffer("inv_freq"), pos.expand(b, t), x.dtype)
        x = self.transformer["drop"](x)
        blocks = self.transformer["h"]
        assert isinstance(blocks, nn.ModuleList)
        for block in blocks:
            x = block(x, rot)
        x = self.transformer["ln_f"](x)
        multiple = VOCAB_MULTIPLE if x.is_cuda else 1
        if targets is not None:
            return self._head_loss(x, self.lm_head.weight, targets, self.cfg.vocab_size, multiple)
        return head_logits(x, self.lm_head.weight, self.cfg.vocab_size, multiple)
