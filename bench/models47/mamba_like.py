"""A Mamba-style language model: a selective scan written as a Python loop over time steps."""
import torch
from torch import nn

VOCAB, D, INNER, LAYERS, T = 256, 64, 128, 4, 64


class ScanBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.in_proj = nn.Linear(D, 2 * INNER)
        self.conv = nn.Conv1d(INNER, INNER, 4, padding=3, groups=INNER)
        self.dt = nn.Linear(INNER, INNER)
        self.a_log = nn.Parameter(torch.zeros(INNER))
        self.out_proj = nn.Linear(INNER, D)

    def forward(self, x):  # (B, T, D)
        u, gate = self.in_proj(self.norm(x)).chunk(2, dim=-1)
        u = self.conv(u.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2).relu()
        decay = torch.exp(-torch.nn.functional.softplus(self.dt(u)) * self.a_log.exp())
        h = torch.zeros_like(u[:, 0])
        outs = []
        for t in range(x.shape[1]):  # the scan: one small step per token
            h = decay[:, t] * h + u[:, t]
            outs.append(h)
        y = torch.stack(outs, dim=1) * torch.sigmoid(gate)
        return x + self.out_proj(y)


class MambaLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(ScanBlock() for _ in range(LAYERS))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x).transpose(1, 2)  # (B, VOCAB, T): cross-entropy over each position


def build_model():
    return MambaLike()


def example_batch(n):
    tokens = torch.randint(0, VOCAB, (n, T + 1))
    return tokens[:, :-1], tokens[:, 1:]
