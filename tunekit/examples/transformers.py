"""Transformer examples in plain torch: a decoder-only LM (``gpt``) and a vision encoder (``vit``).

Both write attention out (query/key/value projections, the score and value
matmuls, the output projection) instead of calling a fused kernel, so the
model graph sees every matmul a paper's cost model needs, and both train the
way people train transformers today: AdamW with weight decay, linear warm-up
then a cosine schedule, gradient clipping at 1.0, and bf16 autocast where the
device supports it (a CUDA GPU with bf16; CPUs run fp32).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from tunekit.workload import Precision, Workload


class Attention(nn.Module):
    """Multi-head self-attention; causal for language models. The heads are the
    channel dimension a tensor-parallel split cuts along."""

    def __init__(self, width: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(n, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
        if self.causal:
            mask = torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1)  # fx-traceable
            scores = scores.masked_fill(mask, float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(n, t, c))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(nn.functional.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int, causal: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, causal)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


# -- gpt --------------------------------------------------------------------------------

GPT = {"vocab": 8192, "width": 384, "heads": 6, "blocks": 6, "seq": 64}
"""About 14 M parameters (11 M in the blocks, 3 M in the embedding; the head is tied)."""


class GPTModel(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, blocks: int, seq: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq, width)
        self.blocks = nn.Sequential(*[Block(width, heads, causal=True) for _ in range(blocks)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as GPT-2 does
        # GPT-2's initialisation: small embeddings, or the tied head starts with huge logits.
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.01)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # arange, not a slice of a stored index: torch.fx traces it (graph capture sees it all)
        x = self.tokens(tokens) + self.positions(
            torch.arange(tokens.shape[1], device=tokens.device)
        )
        return self.head(self.ln(self.blocks(x)))


def _text(n: int, generator: torch.Generator, vocab: int = GPT["vocab"], seq: int = GPT["seq"]):
    # A learnable language: each token is the previous plus a per-sequence stride, with noise.
    start = torch.randint(vocab, (n, 1), generator=generator)
    stride = torch.randint(1, 8, (n, 1), generator=generator)
    noise = (torch.rand(n, seq + 1, generator=generator) < 0.05).long()
    text = (start + stride * torch.arange(seq + 1) + noise) % vocab
    return text[:, :-1], text[:, 1:]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int = 20, total: int = 2000):
    """Linear warm-up for ``warmup`` steps, then a cosine decay to 10% at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _adamw(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def _precision() -> Precision:
    """bf16 where the device has it natively (a CUDA GPU); CPUs train in fp32."""
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


def gpt() -> Workload:
    return Workload(
        name="gpt",
        model=lambda: GPTModel(**GPT),
        make_batch=_text,
        loss=_lm_loss,
        optimizer=_adamw,
        batch_size=4,
        lr=6e-4,
        lr_scaling="sqrt",
        batch_range=(1, 64),
        precision=_precision(),
        scheduler=warmup_cosine,
        clip_grad_norm=1.0,
        description=(
            f"decoder-only LM, {GPT['blocks']} blocks x {GPT['width']} wide, {GPT['heads']} heads, "
            f"sequence {GPT['seq']}, vocabulary {GPT['vocab']}"
        ),
        extra={"family": "transformer"},
    )


# -- gpt-sharded -------------------------------------------------------------------------

GPT_SHARDED = {"vocab": 8192, "width": 256, "heads": 4, "blocks": 6, "seq": 64}
"""About 6.8 M parameters (4.7 M in six blocks); 512 tokens per rank and step."""


def _sharded_text(n: int, generator: torch.Generator):
    return _text(n, generator, GPT_SHARDED["vocab"], GPT_SHARDED["seq"])


def gpt_sharded() -> Workload:
    """A GPT trained as large models are: FSDP2 over the ranks (each block, then the root;
    parameters resharded after forward) and every block's activations checkpointed."""
    return replace(
        gpt(),
        name="gpt-sharded",
        model=lambda: GPTModel(**GPT_SHARDED),
        make_batch=_sharded_text,
        batch_size=8,
        sharding="fsdp",
        reshard_after_forward=True,
        checkpointing="full",
        description=(
            f"decoder-only LM sharded with FSDP2 and checkpointed: {GPT_SHARDED['blocks']} blocks x "
            f"{GPT_SHARDED['width']} wide, sequence {GPT_SHARDED['seq']}, vocabulary "
            f"{GPT_SHARDED['vocab']}"
        ),
    )


# -- vit --------------------------------------------------------------------------------

VIT = {"image": 32, "patch": 4, "width": 192, "heads": 3, "blocks": 6, "classes": 10}
"""A ViT-Tiny-shaped encoder on 32x32 images (64 patches), about 2.7 M parameters."""


class ViT(nn.Module):
    def __init__(self, image: int, patch: int, width: int, heads: int, blocks: int, classes: int):
        super().__init__()
        self.patches = nn.Conv2d(3, width, patch, stride=patch)  # the patch embedding
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.positions = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, width))
        self.blocks = nn.Sequential(*[Block(width, heads, causal=False) for _ in range(blocks)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.positions
        return self.head(self.ln(self.blocks(x))[:, 0])


def _images(n: int, generator: torch.Generator):
    from tunekit.examples.cnn import teacher_labels

    images = torch.randn(n, 3, VIT["image"], VIT["image"], generator=generator)
    return images, teacher_labels(images)


def vit() -> Workload:
    return Workload(
        name="vit",
        model=lambda: ViT(**VIT),
        make_batch=_images,
        optimizer=_adamw,
        batch_size=32,
        lr=1e-3,
        lr_scaling="sqrt",
        batch_range=(8, 512),
        precision=_precision(),
        scheduler=warmup_cosine,
        clip_grad_norm=1.0,
        description=(
            f"vision transformer, {VIT['blocks']} blocks x {VIT['width']} wide on "
            f"{VIT['image']}x{VIT['image']} images in {VIT['patch']}x{VIT['patch']} patches"
        ),
        extra={"family": "transformer", "input_shape": (3, VIT["image"], VIT["image"])},
    )
