"""``horovod.tensorflow.keras.elastic``: the same as ``shoal.keras.elastic``."""

from shoal.keras.elastic import (
    CommitStateCallback,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    KerasState,
    ObjectState,
    State,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    run,
)

__all__ = [
    "CommitStateCallback",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "KerasState",
    "ObjectState",
    "State",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]
