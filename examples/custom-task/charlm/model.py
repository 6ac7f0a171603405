"""A small decoder-only transformer (GPT-2's layout): token and learned position embeddings, pre-LayerNorm
blocks of causal self-attention and an MLP, a final LayerNorm and a head tied to the token embedding.
The default size trains on a 2-core CPU in minutes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from charlm.data import CONTEXT, VOCAB_SIZE


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab: int = VOCAB_SIZE
    context: int = CONTEXT
    width: int = 64
    layers: int = 2
    heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be a multiple of heads ({self.heads})")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (part.view(b, t, self.heads, c // self.heads).transpose(1, 2) for part in self.qkv(x).split(c, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, c))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, cfg.mlp_ratio * cfg.width),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.width, cfg.width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class CharTransformer(nn.Module):
    """Token ids [B, T] (T <= context) -> next-token logits [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or ModelConfig()
        c = self.cfg
        self.tokens = nn.Embedding(c.vocab, c.width)
        self.positions = nn.Embedding(c.context, c.width)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)
        self.head.weight = self.tokens.weight
        self.apply(_init)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[-1]
        if t > self.cfg.context:
            raise ValueError(f"sequence of {t} tokens is longer than the model's context ({self.cfg.context})")
        x = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def _init(module: nn.Module) -> None:
    # GPT-2's initialisation: small weights give near-uniform first predictions (loss ~ ln vocab).
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
