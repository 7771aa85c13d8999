"""Fixtures for the importer tests: helpers live in gguf_fixtures.py, and the converted default
model (`default_model_dir`) in tests/conftest.py, shared with the web page's browser test."""
