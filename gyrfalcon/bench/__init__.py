"""Benchmarks behind `gyrfalcon bench`: serve (an HTTP client against a running server), and the
offline latency / throughput benchmarks as they land."""
