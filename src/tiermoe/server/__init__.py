"""tiermoe.server: the OpenAI- and Anthropic-compatible HTTP API (no torch imports).

`create_app(engine, served_model_name=...)` in `tiermoe.server.app` builds the ASGI app around
an `tiermoe.engine.async_engine.AsyncEngine`; `tiermoe serve` (server/cli.py) runs it.
"""
