"""Poseidon-style per-layer communication planning: calibration, cost model, sufficient factor broadcasting."""
