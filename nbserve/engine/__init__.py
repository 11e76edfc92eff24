"""The engine: one thread owns the model and its KV cache, callers stream events from any loop.

`Engine` (engine.py) is the thread-safe front; `EngineStep` (step.py) is what runs on the
engine thread; see docs/architecture.md for the other modules.
"""

from .engine import Engine

__all__ = ["Engine"]
