"""A Swin-style image classifier (timm-free): windowed attention, shifted windows every other block, patch merging.

10 classes, 64x64 images: patches of 4 (16x16 tokens, 48 channels), two stages of two blocks with windows of 4,
merged to 8x8 tokens of 96 channels between them.
"""
import torch
from torch import nn

IMAGE, PATCH, WINDOW, CLASSES = 64, 4, 4, 10
DIMS, HEADS, DEPTHS = (48, 96), (3, 6), (2, 2)


def windows(x, size):  # (B, H, W, C) -> (B * windows, size * size, C)
    B, H, W, C = x.shape
    x = x.view(B, H // size, size, W // size, size, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, size * size, C)


def unwindows(x, size, B, H, W):  # the inverse of windows
    C = x.shape[-1]
    x = x.view(B, H // size, W // size, size, size, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, H, W, C)


def shift_mask(H, W, size, shift):  # (windows, size*size, size*size): -inf between tokens the roll brought together
    region = torch.zeros(1, H, W, 1)
    cuts = (slice(0, -size), slice(-size, -shift), slice(-shift, None))
    for n, (h, w) in enumerate((h, w) for h in cuts for w in cuts):
        region[:, h, w, :] = n
    ids = windows(region, size).squeeze(-1)
    return (ids[:, None, :] != ids[:, :, None]).float() * -1e4


class WindowAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.zeros(heads, WINDOW * WINDOW, WINDOW * WINDOW))  # learnt relative bias, simplified

    def forward(self, x, mask):  # x: (N, T, C), mask: (windows, T, T) or None
        N, T, C = x.shape
        q, k, v = self.qkv(x).view(N, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # (N, h, T, d) each
        scores = (q * (C // self.heads) ** -0.5) @ k.transpose(-2, -1) + self.bias
        if mask is not None:
            scores = scores.view(-1, mask.shape[0], self.heads, T, T) + mask[None, :, None]
            scores = scores.view(N, self.heads, T, T)
        out = scores.softmax(-1) @ v  # (N, h, T, d)
        return self.proj(out.transpose(1, 2).reshape(N, T, C))


class SwinBlock(nn.Module):
    def __init__(self, dim, heads, resolution, shifted):
        super().__init__()
        self.shift = WINDOW // 2 if shifted else 0
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        mask = shift_mask(resolution, resolution, WINDOW, self.shift) if self.shift else None
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):  # (B, H, W, C)
        B, H, W, C = x.shape
        y = self.norm1(x)
        if self.shift:
            y = torch.roll(y, (-self.shift, -self.shift), dims=(1, 2))
        y = unwindows(self.attn(windows(y, WINDOW), self.mask), WINDOW, B, H, W)
        if self.shift:
            y = torch.roll(y, (self.shift, self.shift), dims=(1, 2))
        x = x + y
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduce = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):  # (B, H, W, C) -> (B, H/2, W/2, 2C)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduce(self.norm(x))


class SwinLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, DIMS[0], PATCH, stride=PATCH)
        resolution = IMAGE // PATCH
        stages = []
        for stage, (dim, heads, depth) in enumerate(zip(DIMS, HEADS, DEPTHS)):
            if stage:
                stages.append(PatchMerging(DIMS[stage - 1]))
                resolution //= 2
            stages += [SwinBlock(dim, heads, resolution, shifted=i % 2 == 1) for i in range(depth)]
        self.blocks = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(DIMS[-1])
        self.head = nn.Linear(DIMS[-1], CLASSES)

    def forward(self, images):  # (B, 3, 64, 64)
        x = self.embed(images).permute(0, 2, 3, 1)  # (B, 16, 16, C)
        x = self.blocks(x)
        return self.head(self.norm(x).mean(dim=(1, 2)))


def build_model():
    return SwinLike()


def example_batch(n):
    return torch.rand(n, 3, IMAGE, IMAGE), torch.randint(0, CLASSES, (n,))
