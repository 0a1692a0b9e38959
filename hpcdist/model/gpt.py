"""A decoder-only transformer language model (GPT-2 layout), sized from a job spec.

Parameter names follow Hugging Face's GPT-2 (``transformer.h.0.attn.c_attn.weight`` ...) so a
checkpoint maps onto ``transformers.GPT2LMHeadModel`` by transposing the linear weights (GPT-2
stores them as Conv1D, in x out). The head is tied to the token embedding.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn


class GPTConfig(BaseModel):
    """Model size and shape; validated so a bad spec fails before any weight is made."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(default=257, ge=2)
    context: int = Field(default=256, ge=1, description="maximum sequence length")
    n_layer: int = Field(default=4, ge=1)
    n_head: int = Field(default=4, ge=1)
    d_model: int = Field(default=128, ge=1)
    mlp: Literal["gelu", "swiglu"] = "gelu"
    mlp_ratio: float = Field(default=4.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    ln_eps: float = Field(default=1e-5, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> GPTConfig:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")
        return self

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head

    @property
    def d_hidden(self) -> int:
        return int(self.mlp_ratio * self.d_model)

    def num_params(self) -> int:
        d, h, v = self.d_model, self.d_hidden, self.vocab_size
        mlp_in = (2 if self.mlp == "swiglu" else 1) * h
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * mlp_in + mlp_in) + (h * d + d)
        return v * d + self.context * d + self.n_layer * block + 2 * d

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), as in the PaLM paper's appendix B."""
        n = self.num_params() - self.context * self.d_model
        return 6.0 * n + 12.0 * self.n_layer * self.d_model * self.context


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
        self.lm_head.weight = self.transformer["wte"].weight  # tied
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
        for block in self.transformer["h"]:
            x = block(x)
        return self.lm_head(self.transformer["ln_f"](x))
