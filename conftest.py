"""Suite-wide settings for tests under tests/ and plugins/."""

import os

# run_ranks keeps its spawned gloo ranks between tests (tunekit.rank_pool): each
# fresh rank would spend about 3.5 s importing torch and torch._dynamo.
os.environ.setdefault("TUNEKIT_REUSE_RANKS", "1")
