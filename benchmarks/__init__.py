"""Benchmarks that `make bench` runs; they print figures and never assert (see __main__)."""
