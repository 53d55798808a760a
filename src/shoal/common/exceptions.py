"""``horovod.common.exceptions``: the same classes as ``shoal.exceptions``, under Horovod's module path."""

from shoal.exceptions import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
