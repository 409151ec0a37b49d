"""Commands of this group are registered by ``register(app)`` (not yet built)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to the servescope app."""
