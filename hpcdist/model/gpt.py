"""A decoder-only transformer language model (GPT-2 layout), sized from a job spec.

Parameter names follow Hugging Face's GPT-2 (``transformer.h.0.attn.c_attn.weight`` ...) so a
checkpoint maps onto ``transformers.GPT2LMHeadModel`` by transposing the linear weights (GPT-2
stores them as Conv1D, in x out). The head is tied to the token embedding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hpcdist.model.config import GPTConfig

__all__ = ["GPTConfig", "GPT"]


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.d_head = cfg.n_head, cfg.d_head
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, self.d_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.kind = cfg.mlp
        width = cfg.d_hidden * (2 if cfg.mlp == "swiglu" else 1)
        self.c_fc = nn.Linear(cfg.d_model, width)
        self.c_proj = nn.Linear(cfg.d_hidden, cfg.d_model)

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
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(cfg.vocab_size, cfg.d_model),
                "wpe": nn.Embedding(cfg.context, cfg.d_model),
                "drop": nn.Dropout(cfg.dropout),
                "h": nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                "ln_f": nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps),
            }
        )
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        wte = self.transformer["wte"]
        assert isinstance(wte, nn.Embedding)
        self.lm_head.weight = wte.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, vocab) for token ids (batch, time)."""
        _, t = idx.shape
        if t > self.cfg.context:
            raise ValueError(f"sequence of {t} tokens is longer than the context {self.cfg.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.transformer["drop"](self.transformer["wte"](idx) + self.transformer["wpe"](pos))
        blocks = self.transformer["h"]
        assert isinstance(blocks, nn.ModuleList)
        for block in blocks:
            x = block(x)
        return self.lm_head(self.transformer["ln_f"](x))
