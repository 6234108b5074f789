"""Benchmarks behind `hvd-onebit bench ...`; each returns plain dicts ready for JSON."""
