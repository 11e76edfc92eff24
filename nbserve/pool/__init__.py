"""A pool of engine replicas across devices, behind the engine's own API (a `Backend`)."""

from .pool import Pool

__all__ = ["Pool"]
