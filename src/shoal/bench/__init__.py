"""Benchmarks, each runnable under the launcher (``shoalrun -np 2 python -m shoal.bench.allreduce``).

Every benchmark measures Shoal against raw torch.distributed in the same run and ends with one JSON line.
"""
