"""accumcore's implementation: private, free to change between releases.

The public API is what ``accumcore.__all__`` names, with ``accumcore.memory`` and
``accumcore.checkpointing``; CONTRIBUTING.md maps the modules here.
"""
