"""The only package that calls ``torch.distributed``.

Strategies (the engine, the planner, the parameter server) ask this package to move bytes; they never touch
the wire themselves.
"""
