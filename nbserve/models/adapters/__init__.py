"""Adapters that make models without nbserve's StepModel interface servable (more slowly)."""

from .common import SlowPathWarning, eval_view
from .hf import TransformersAdapter
from .recompute import RecomputeAdapter

__all__ = ["RecomputeAdapter", "SlowPathWarning", "TransformersAdapter", "eval_view"]
