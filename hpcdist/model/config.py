"""The model's size and shape (GPTConfig): pydantic only, so job params and the login node can
validate a model section without importing torch. ``hpcdist.model.gpt`` re-exports it.

One decoder family, configured: the defaults are GPT-2 (LayerNorm, learned positions, biases
everywhere, a head tied to the embedding), so a checkpoint written before the other fields
existed reads as the same GPT-2. The LLaMA shape (Llama 2/3, Mistral, Qwen2) sets RMSNorm,
rotary positions (``rope_theta``, optionally Llama 3's frequency scaling), the SwiGLU MLP,
fewer key/value heads than query heads (``n_kv_head``), a ``head_dim`` of its own, an untied
head and biases on q/k/v only (Qwen2) or nowhere (Llama, Mistral).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FAMILIES = ("gpt2", "llama", "mistral", "qwen2")


class RopeScaling(BaseModel):
    """Llama 3's rotary frequency scaling (transformers' ``rope_type: llama3``), the one scaling supported."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_context: int = Field(ge=1, description="original_max_position_embeddings")

    @model_validator(mode="after")
    def _ordered(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor {self.high_freq_factor} must exceed low_freq_factor "
                             f"{self.low_freq_factor}")
        return self


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
    ln_eps: float = Field(default=1e-5, gt=0, description="epsilon of every norm, LayerNorm or RMSNorm")
    # the LLaMA shape; each default is GPT-2's
    family: Literal["gpt2", "llama", "mistral", "qwen2"] = Field(
        default="gpt2", description="the Hugging Face architecture export writes")
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    positions: Literal["learned", "rope"] = "learned"
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    n_kv_head: int | None = Field(default=None, ge=1, description="key/value heads (GQA); default n_head")
    head_dim: int | None = Field(default=None, ge=1, description="default d_model / n_head")
    d_ff: int | None = Field(default=None, ge=1, description="MLP hidden size; default mlp_ratio x d_model")
    tied: bool = Field(default=True, description="the head is the token embedding")
    attention_bias: bool = Field(default=True, description="biases on q, k and v")
    attention_out_bias: bool = Field(default=True, description="a bias on the attention's output projection")
    mlp_bias: bool = True
    sliding_window: int | None = Field(
        default=None, ge=1, description="attention window; longer sequences are refused, not approximated")

    @model_validator(mode="after")
    def _heads_divide(self) -> GPTConfig:
        if self.head_dim is None and self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")
        if self.n_head % self.n_kv:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv}")
        if self.positions == "rope" and self.d_head % 2:
            raise ValueError(f"rotary positions need an even head_dim, not {self.d_head}")
        if self.rope_scaling is not None and self.positions != "rope":
            raise ValueError("rope_scaling needs positions: rope")
        return self

    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_head

    @property
    def n_kv(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def d_hidden(self) -> int:
        return self.d_ff if self.d_ff is not None else int(self.mlp_ratio * self.d_model)

    def num_params(self) -> int:
        d, h, v, hd = self.d_model, self.d_hidden, self.vocab_size, self.d_head
        q, kv = self.n_head * hd, self.n_kv * hd
        mlp_in = (2 if self.mlp == "swiglu" else 1) * h
        norm = d * (2 if self.norm == "layernorm" else 1)
        attn = d * (q + 2 * kv) + (q + 2 * kv) * self.attention_bias + q * d + d * self.attention_out_bias
        mlp = d * mlp_in + h * d + (mlp_in + d) * self.mlp_bias
        embed = v * d * (1 if self.tied else 2) + (self.context * d if self.positions == "learned" else 0)
        return embed + self.n_layer * (2 * norm + attn + mlp) + norm

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), as in the PaLM paper's appendix B."""
        n = self.num_params() - (self.context * self.d_model if self.positions == "learned" else 0)
        return 6.0 * n + 12.0 * self.n_layer * self.n_head * self.d_head * self.context

    def check_length(self, tokens: int) -> str | None:
        """Why a sequence of `tokens` cannot run on this model (context, sliding window); None when it can."""
        if tokens > self.context:
            return f"{tokens} tokens is longer than the model's context of {self.context}"
        if self.sliding_window is not None and tokens > self.sliding_window:
            return (f"{tokens} tokens is longer than the model's sliding_window of {self.sliding_window}, and "
                    f"sliding-window attention is not implemented; keep prompt plus new tokens within it")
        return None
