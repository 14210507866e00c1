"""Vision Transformers from small configs, for tests.

* :func:`torchvision_vit`: torchvision's ``VisionTransformer`` (what ``vit_b_16`` builds) at
  a 32-pixel image, 2 layers, 64 wide.
* :func:`workload`: a ViT written as timm writes ``VisionTransformer`` (timm is not a
  dependency): a conv patch embedding, a class token and learned positions, blocks whose
  attention is one fused ``qkv`` linear, ``reshape``/``permute``/``unbind`` and
  ``F.scaled_dot_product_attention``, and a ``forward(x, attn_mask=None)`` whose optional
  argument is a graph input that no batch fills (what crashed layer_split).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tunekit.workload import Workload

IMAGE, PATCH, WIDTH, HEADS, DEPTH, CLASSES = 32, 8, 64, 4, 2, 10


class PatchEmbed(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Conv2d(3, WIDTH, kernel_size=PATCH, stride=PATCH)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, patches, width)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, WIDTH // HEADS
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, attn_mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = (
            nn.Linear(WIDTH, 2 * WIDTH),
            nn.GELU(),
            nn.Linear(2 * WIDTH, WIDTH),
        )

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.norm2, self.mlp = nn.LayerNorm(WIDTH), Mlp()

    def forward(self, x, attn_mask=None):
        x = x + self.attn(self.norm1(x), attn_mask=attn_mask)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = PatchEmbed()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, WIDTH))
        self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, WIDTH) * 0.02)
        self.blocks = nn.ModuleList([Block() for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, attn_mask=None):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x, attn_mask=attn_mask)
        return self.head(self.norm(x)[:, 0])


def images(n: int, generator: torch.Generator):
    x = torch.randn(n, 3, IMAGE, IMAGE, generator=generator)
    return x, (x.mean(dim=(1, 2, 3)) > 0).long()


def _workload(name: str, model) -> Workload:
    return Workload(
        name=name,
        model=model,
        make_batch=images,
        batch_size=8,
        lr=1e-3,
        optimizer=lambda params, lr: torch.optim.AdamW(params, lr=lr),
        extra={"family": "transformer", "input_shape": (3, IMAGE, IMAGE)},
    )


def workload() -> Workload:
    """The timm-style ViT."""
    return _workload("vit-timm-style", VisionTransformer)


def torchvision_vit() -> Workload:
    """torchvision's VisionTransformer (vit_b_16's class) from a small config."""
    from torchvision.models.vision_transformer import VisionTransformer as TorchvisionViT

    return _workload(
        "vit-torchvision",
        lambda: TorchvisionViT(
            image_size=IMAGE,
            patch_size=PATCH,
            num_layers=DEPTH,
            num_heads=HEADS,
            hidden_dim=WIDTH,
            mlp_dim=2 * WIDTH,
            num_classes=CLASSES,
        ),
    )
