"""Built-in models; importing this package registers their train specs."""

from torchtitan.models import llama3  # noqa: F401
