"""kvd benchmarks: baselines (memcpy, raw TCP, raw pyzmq) and kvd's cases, measured in one run."""
