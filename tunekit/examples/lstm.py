"""A language model shaped like the papers' BigLSTM, small by default.

BigLSTM (Jozefowicz et al., used by DLPlacer) is an embedding, two LSTM layers
with a projection (LSTMP: 8192 cells projected to 1024) and a softmax over an
800k vocabulary. This keeps the shape with sizes a CPU can train; the
synthetic text follows a fixed noisy rule so there is something to learn.
"""

from __future__ import annotations

import torch
from torch import nn

from tunekit.workload import Workload

VOCAB = 10_000
EMBED = 256
HIDDEN = 1024
PROJ = 256
LAYERS = 2
SEQ = 20


class BigLSTM(nn.Module):
    def __init__(self, vocab=VOCAB, embed=EMBED, hidden=HIDDEN, proj=PROJ, layers=LAYERS):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, proj_size=proj, batch_first=True)
        self.decoder = nn.Linear(proj, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(tokens))
        return self.decoder(out)  # batch x seq x vocab


def make_batch(n: int, generator: torch.Generator):
    # Each next token is a fixed affine function of the current one, with noise.
    start = torch.randint(VOCAB, (n, 1), generator=generator)
    steps = torch.arange(SEQ + 1).unsqueeze(0)
    noise = torch.randint(0, 3, (n, SEQ + 1), generator=generator)
    seq = (start + 31 * steps + noise) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def workload() -> Workload:
    return Workload(
        name="lstm",
        model=BigLSTM,
        make_batch=make_batch,
        loss=sequence_loss,
        optimizer=lambda params, lr: torch.optim.Adam(params, lr=lr),
        batch_size=16,
        lr=1e-3,
        lr_scaling="sqrt",
        batch_range=(4, 256),
        description=f"2-layer LSTMP {HIDDEN}->{PROJ}, vocab {VOCAB}, seq {SEQ}",
        extra={"family": "rnn"},
    )
