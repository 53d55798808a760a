"""Horovod's ``horovod.common`` names, for scripts that import them from there."""
