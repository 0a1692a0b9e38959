"""The version of hpcdist (both sides: the rendered script, results and checkpoints record it)."""

__version__ = "0.1.0"
