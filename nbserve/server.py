"""Kept for code that imports `nbserve.server`: the app lives in `nbserve.serving.app`."""

from .serving.app import create_app

__all__ = ["create_app"]
