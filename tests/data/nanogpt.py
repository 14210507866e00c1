"""A nanoGPT-style GPT, written the way nanoGPT's ``model.py`` writes it (MIT), for tests.

Not a copy: an equivalent with the parts that matter to tunekit kept as they are in
the models people actually train:

* attention through ``F.scaled_dot_product_attention(..., is_causal=True)`` followed by
  ``.transpose(1, 2).contiguous().view(B, T, C)`` (with a masked-softmax fallback
  behind ``if self.flash``), ``split`` of one fused qkv projection;
* control flow ``torch.fx`` cannot trace: ``B, T = idx.size()``, an ``assert`` on the
  sequence length, ``if targets is not None`` choosing between the training loss and
  the last position's logits;
* the model computes its own loss (``forward(idx, targets) -> (logits, loss)``),
  weight tying between the token embedding and the head, a ``ModuleDict`` of parts.

The workloads at the bottom are how a user points tunekit at such a model without
changing it: the inputs are ``(idx, targets)``, passed to a thin wrapper as ONE
argument (tunekit's convention, the one the training ranks use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tunekit.workload import Workload


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """LayerNorm whose bias can be switched off (``nn.LayerNorm`` had no ``bias=`` once)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.flash = hasattr(F, "scaled_dot_product_attention")
        if not self.flash:
            mask = torch.tril(torch.ones(config.block_size, config.block_size))
            self.register_buffer("bias", mask.view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None,
                dropout_p=self.dropout if self.training else 0,
                is_causal=True,
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = self.attn_dropout(F.softmax(att, dim=-1))
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # scaled init of the residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, (
            f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        )
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        else:  # inference: only the last position's logits
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


# -- workloads: the unmodified model, driven the tunekit way -------------------------------

CONFIG = GPTConfig()


class GPTWithLoss(nn.Module):
    """The user's thin wrapper: tunekit calls ``model(inputs)`` with ONE argument, the
    batch's inputs, here the tuple ``(idx, targets)``; nanoGPT's GPT computes the loss."""

    def __init__(self, config: GPTConfig = CONFIG):
        super().__init__()
        self.gpt = GPT(config)

    def forward(self, inputs):
        idx, targets = inputs
        return self.gpt(idx, targets)


def tokens(n: int, generator: torch.Generator):
    """Sequences a model can learn (each token one more than the last), as nanoGPT's
    ``get_batch`` returns them: ``x`` and ``y`` shifted by one."""
    start = torch.randint(CONFIG.vocab_size, (n, 1), generator=generator)
    seq = (start + torch.arange(CONFIG.block_size + 1)) % CONFIG.vocab_size
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # as torch.stack gives them
    return (x, y), y


def own_loss(outputs, _targets):
    """The model's own loss (nanoGPT returns ``(logits, loss)``)."""
    return outputs[1]


def workload() -> Workload:
    """nanoGPT's model, unmodified, with its own loss, AdamW, sqrt scaling, clipping."""
    return Workload(
        name="nanogpt",
        model=GPTWithLoss,
        make_batch=tokens,
        loss=own_loss,
        optimizer=lambda params, lr: torch.optim.AdamW(
            params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1
        ),
        batch_size=4,
        lr=6e-4,
        lr_scaling="sqrt",
        batch_range=(2, 32),
        clip_grad_norm=1.0,
        extra={"family": "transformer"},
    )
