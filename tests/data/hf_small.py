"""Hugging Face GPT-2 and Llama from small configs (random weights, nothing downloaded)."""

from __future__ import annotations

import transformers

from tunekit.workloads.huggingface import hf_workload

SEQ = 16


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return hf_workload(config, transformers.GPT2LMHeadModel, seq_len=SEQ, batch_size=2)


def llama():
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return hf_workload(config, transformers.LlamaForCausalLM, seq_len=SEQ, batch_size=2)
