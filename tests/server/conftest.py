"""Server test fixtures live in server_harness.py (a uniquely named module tests can import)."""

from server_harness import *  # noqa: F401,F403
