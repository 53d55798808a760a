"""Sharded parameter server (Poseidon): servers and client, push/pull, BSP/SSP/async, server-side optimizers.

Workers push each layer's gradient the moment backprop produces it and pull fresh parameters in ``step()``; the
servers own the parameters, split by bytes (``sharding``), apply the optimizer (``optimizers``) under a
consistency model (``consistency``), and reply. Servers run either as dedicated processes
(``python -m shoal.ps.server``, started by ``shoalrun --num-servers S``; see ``launch``) or as a thread inside
every worker (co-located, S = P). Use it through ``hvd.DistributedOptimizer(..., comm="ps")``.
"""
