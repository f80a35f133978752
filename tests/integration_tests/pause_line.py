"""The line the checkpoint pause hook logs (``pause_checkpoint_publish.py``), in a module of
its own: importing the hook installs it, which only the trainer process under test may do."""

PAUSE_LINE = "test hook: pausing before publishing"
