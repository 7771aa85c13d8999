"""Store test fixtures live in store_fixtures.py (a uniquely named module tests can import)."""

from store_fixtures import *  # noqa: F401,F403
