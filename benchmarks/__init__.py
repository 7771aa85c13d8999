"""Developer benchmarks and diagnostics of tiermoe, kept outside the product package.

They import the product (tiermoe) and never the other way round: the product's `bench` command
group only names the modules here that join it (tiermoe/bench/cli.py, BENCH_EXTRA_MODULES) and
skips any that is not installed. See README.md for what lives here and why.
"""
