"""The Textual app behind ``tunekit tui``: see :mod:`tunekit.tui.app` and docs/tui.md.

Importing this package imports nothing else: the core never depends on it.
"""
