"""Test doubles and fixtures, imported by tests, benchmarks and examples only (their processes),
never by the daemon, the client library or an integration.

`daemons` starts real `kvd serve` daemons in subprocesses on free loopback ports; `sglang_pool` is a
stand-in for SGLang's host KV pool (SGLang's engine does not run on a CPU-only machine).
"""
