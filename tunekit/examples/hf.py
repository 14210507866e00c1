"""``example:hf-gpt2``: a small GPT-2 built from a ``transformers`` config (``tunekit[hf]``).

Random weights, synthetic token batches: nothing is downloaded. Four blocks of
128 wide (about 0.9 M parameters with a 1,024-token vocabulary) on 64-token
sequences, so a CPU trains it in well under a second a step.
"""

from __future__ import annotations

from tunekit.workload import Workload

GPT2_SMALL = {"vocab_size": 1024, "n_positions": 64, "n_embd": 128, "n_layer": 4, "n_head": 4}
SEQ_LEN = 64


def gpt2() -> Workload:
    # Imported here: the extra is optional, and a missing one is one line naming it.
    # transformers through the helper: without it, the import is one line naming the extra
    from tunekit.workloads.huggingface import hf_workload, transformers

    config = transformers.GPT2Config(**GPT2_SMALL, bos_token_id=0, eos_token_id=0)
    return hf_workload(
        config,
        transformers.GPT2LMHeadModel,
        name="hf-gpt2",
        seq_len=SEQ_LEN,
        batch_size=8,
        lr=5e-4,
        batch_range=(2, 64),
        clip_grad_norm=1.0,
    )
