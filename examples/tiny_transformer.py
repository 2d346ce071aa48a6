"""A small transformer classifier over token sequences: a model file for autofit.

    autofit probe examples/tiny_transformer.py -m 16 --list-blocks
    autofit plan examples/tiny_transformer.py --budget 200MB --batch-size 64

Layers use nn.MultiheadAttention; set ATTENTION = "sdpa" to use
scaled_dot_product_attention instead.
"""
import torch
from torch import nn
from torch.nn import functional as F

VOCAB_SIZE = 1000
SEQ_LEN = 64
NUM_CLASSES = 4
D_MODEL = 128
N_HEADS = 4
N_LAYERS = 4
ATTENTION = "mha"


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, attention: str) -> None:
        super().__init__()
        self.attention = attention
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        if attention == "mha":
            self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        else:
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        h = self.norm1(x)
        if self.attention == "mha":
            h, _ = self.attn(h, h, h, need_weights=False)
        else:
            B, T, C = h.shape
            q, k, v = self.qkv(h).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)  # (B, H, T, D) each
            h = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C))
        x = x + h
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, attention: str = ATTENTION) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, D_MODEL)
        self.pos = nn.Parameter(torch.zeros(1, SEQ_LEN, D_MODEL))
        self.layers = nn.ModuleList(Block(D_MODEL, N_HEADS, attention) for _ in range(N_LAYERS))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, NUM_CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, classes)
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(dim=1))


def build_model() -> nn.Module:
    return TinyTransformer()


def example_batch(batch_size: int):
    tokens = torch.randint(0, VOCAB_SIZE, (batch_size, SEQ_LEN))
    return tokens, torch.randint(0, NUM_CLASSES, (batch_size,))
