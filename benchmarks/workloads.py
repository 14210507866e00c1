"""Workloads of the prediction benchmarks that tunekit has no built-in example for.

``benchmarks/workloads.py:resnet`` — a ResNet-18 on 64x64 synthetic images
(the papers' ResNet-152 at 224x224 takes seconds per step on 2 CPU cores), and
``benchmarks/workloads.py:transformer_lm`` — a small causal transformer
language model (4 pre-norm blocks, 256 wide, 4 heads) on synthetic tokens,
written in plain torch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tunekit.workload import Workload

VOCAB, WIDTH, HEADS, BLOCKS, SEQ = 2048, 256, 4, 4, 64


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, width: int = WIDTH, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(n, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(n, t, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class TransformerLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(1, SEQ, WIDTH))
        self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        return self.head(self.ln(self.blocks(x)))


def _tokens(n: int, generator: torch.Generator):
    # A learnable task: the next token is the current one plus one, modulo the vocabulary.
    start = torch.randint(VOCAB, (n, 1), generator=generator)
    seq = (start + torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def transformer_lm() -> Workload:
    return Workload(
        name="transformer_lm",
        model=TransformerLM,
        make_batch=_tokens,
        loss=_lm_loss,
        optimizer=lambda params, lr: torch.optim.AdamW(params, lr=lr),
        batch_size=16,
        lr=3e-4,
        lr_scaling="sqrt",
        batch_range=(4, 128),
        description=f"causal transformer LM, {BLOCKS} blocks x {WIDTH} wide, sequence {SEQ}",
        extra={"family": "transformer"},
    )


def resnet() -> Workload:
    from torchvision.models import resnet18

    def make_batch(n: int, generator: torch.Generator):
        images = torch.randn(n, 3, 64, 64, generator=generator)
        return images, images.mean(dim=(1, 2, 3)).gt(0).long()

    return Workload(
        name="resnet18_64",
        model=lambda: resnet18(num_classes=2),
        make_batch=make_batch,
        batch_size=16,
        lr=0.01,
        batch_range=(4, 128),
        description="torchvision ResNet-18 on synthetic 64x64 images",
        extra={"family": "cnn", "input_shape": (3, 64, 64)},
    )
