"""The model's size and shape (GPTConfig): pydantic only, so job params and the login node can
validate a model section without importing torch. ``hpcdist.model.gpt`` re-exports it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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
