"""``mirrorsd serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn) on top of :mod:`mirrorsd.api`."""

from .app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
