"""Passes amp hands to Inductor (with Inductor as the inner compiler): they steer what it
generates on the joint forward+backward graph, after decomposition and in its partitioner.
None changes a value; each is cache-keyed by its source (``InductorPass``).

The pipeline passes that make the precision plan live in ``amp_compiler.passes``.
"""
