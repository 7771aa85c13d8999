"""Helpers shared by more than one test directory.

Importable as `testkit` from any test: pytest's default (prepend) import mode puts tests/ on
sys.path when it loads tests/conftest.py. Directory-local helpers stay in their own uniquely
named modules (tests/server/server_harness.py, tests/store/store_fixtures.py,
tests/reliability/reliability_util.py), which build on these.
"""
