"""Imported last by the forkserver that ``shoal.testing.run_ranks`` forks ranks from: collect once, then freeze what
the preloaded modules made (torch, torch._dynamo, TensorFlow), as CPython's gc docs advise for a server that forks.

Every full collection in a rank then skips those objects. Shoal's engine collects at shutdown, to free its process
groups, and a full collection over torch and TensorFlow takes 0.1-0.4 s.
"""

import gc

gc.collect()
gc.freeze()
