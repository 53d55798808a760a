"""Per-layer communication that runs collectives: measuring the network for the planner (``calibrate``) and
sufficient factor broadcasting's layer wrapper (``sfb``). The cost model they feed is ``shoal.plan``."""
