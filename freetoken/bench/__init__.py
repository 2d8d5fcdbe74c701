"""Measurements the engine is configured from (`python -m freetoken bench ...`)."""
