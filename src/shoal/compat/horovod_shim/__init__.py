"""Not a package to import: its ``horovod`` directory is what shoalrun --horovod-compat puts on PYTHONPATH."""
