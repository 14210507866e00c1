"""Workload builders for model libraries, each behind its own optional extra.

``tunekit.workloads.huggingface`` (``pip install 'tunekit[hf]'``): Hugging Face
``transformers`` models from a config. Nothing here is imported by the core.
"""
