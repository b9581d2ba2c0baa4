"""The pieces of ``tools/bench.py``, by job: workloads, variants, measurements, reports."""
