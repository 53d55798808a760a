"""``python -m shoal.runner``: the same as ``shoalrun``."""

from shoal.runner import console_main

console_main()
