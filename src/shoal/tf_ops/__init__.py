"""The TensorFlow front end's machinery: Horovod's TensorFlow collectives on Shoal's engine (``ops``), their
compressors, errors and the gradient reducer that ``DistributedGradientTape`` and the Keras optimizer share.

Users import ``shoal.tensorflow`` (Horovod's ``horovod.tensorflow``), which presents these together with the Keras
pieces Horovod also puts there; keeping the machinery in its own package lets ``shoal.keras`` build on it while
``shoal.tensorflow`` builds on both, with no import cycle.
"""
