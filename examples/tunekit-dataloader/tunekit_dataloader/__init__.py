"""dataloader: a worked third-party tunekit tuner (tunekit finds it through its entry point)."""
