# Put first on PYTHONPATH by tests/unit/test_hf_workload.py: Python sees no transformers
# library, as on a machine without the `hf` extra (the real one stays installed).
raise ModuleNotFoundError("No module named 'transformers'", name="transformers")
