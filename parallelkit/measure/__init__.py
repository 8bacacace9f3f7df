"""Measuring: what a step moves, computes, costs and takes, read from the compiled program, profiler and clock."""
