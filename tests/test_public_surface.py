"""Freeze the public surface: hvd names, shoalrun flags and environment variables. Changing them is deliberate."""

from __future__ import annotations

import shoal.torch as hvd
from shoal.config import KNOB_NAMES, RENDEZVOUS_ENV_NAMES, WORKER_ENV_NAMES
from shoal.runner.cli import build_parser

COLLECTIVE_NAMES = {
    "Adasum", "Average", "Compression", "DistributedOptimizer", "SyncBatchNorm", "broadcast_parameters",
    "broadcast_optimizer_state", "plan_report", "Max", "Min", "ProcessSet", "Product", "Sum", "add_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "global_process_set", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "join", "poll", "reducescatter", "reducescatter_async",
    "remove_process_set", "start_timeline", "stop_timeline", "synchronize",
}  # fmt: skip

HVD_NAMES = COLLECTIVE_NAMES | {
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "sparse_allreduce_async",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
    "elastic",
}

ELASTIC_NAMES = {
    "ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run",
}  # fmt: skip

SHOALRUN_FLAGS = {
    "-h", "--help", "-v", "--version", "-np", "--num-proc", "-cb", "--check-build", "-H", "--hosts",
    "-hostfile", "--hostfile", "-p", "--ssh-port", "-i", "--ssh-identity-file", "--start-timeout",
    "--ssh-strict-host-key-checking", "-x", "--env", "--horovod-compat", "--network-interfaces", "--slots-per-host",
    "--min-num-proc", "--max-num-proc", "-prefix-timestamp", "--prefix-output-with-timestamp", "--log-with-timestamp",
    "--log-without-timestamp", "--log-hide-timestamp", "--no-log-hide-timestamp", "--no-timeline-mark-cycles",
    "--no-hierarchical-allreduce", "--stall-check", "--gloo-timeout-seconds", "--config-file", "--ranks-filter",
    "--autotune", "--no-autotune", "--autotune-log-file", "--autotune-warmup-samples", "--autotune-steps-per-sample",
    "--autotune-bayes-opt-max-samples", "--autotune-gaussian-process-noise",
    "--network-interface", "--gloo", "--output-filename", "--verbose", "--log-level", "--timeline-filename",
    "--timeline-mark-cycles",
    "--hierarchical-allreduce", "--fusion-threshold-mb", "--cycle-time-ms", "--cache-capacity", "--disable-cache",
    "--no-stall-check", "--stall-check-warning-time-seconds", "--stall-check-shutdown-time-seconds",
    "--min-np", "--max-np", "--host-discovery-script", "--elastic-timeout", "--reset-limit", "--num-servers",
}  # fmt: skip


def test_hvd_public_names_are_frozen() -> None:
    assert set(hvd.__all__) == HVD_NAMES
    for name in HVD_NAMES - {"Adasum", "Average", "Max", "Min", "Product", "Sum", "global_process_set", "elastic"}:
        assert callable(getattr(hvd, name)), name
    assert [hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product] == [0, 1, 2, 3, 4, 5]
    assert set(hvd.elastic.__all__) == ELASTIC_NAMES


def test_shoalrun_flags_are_frozen() -> None:
    flags = {option for action in build_parser()._actions for option in action.option_strings}
    assert flags == SHOALRUN_FLAGS


def test_environment_names_are_frozen() -> None:
    assert WORKER_ENV_NAMES == ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")
    assert RENDEZVOUS_ENV_NAMES == ("SHOAL_RENDEZVOUS_ADDR", "SHOAL_RENDEZVOUS_PORT", "SHOAL_SECRET")
    assert {"FUSION_THRESHOLD", "CYCLE_TIME", "CACHE_CAPACITY", "TIMELINE", "LOG_LEVEL"} <= set(KNOB_NAMES)
    assert {"STALL_CHECK_TIME_SECONDS", "STALL_SHUTDOWN_TIME_SECONDS", "COLLECTIVE_TIMEOUT_SECONDS"} <= set(KNOB_NAMES)


# Every public name of horovod.torch 0.28.1 (its __init__.py imports) and of horovod.torch.mpi_ops' functions.
HOROVOD_TORCH_NAMES = {
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min", "ProcessSet",
    "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_initialized", "join", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async",
    "start_timeline", "stop_timeline", "synchronize",
}  # fmt: skip
HOROVOD_MPI_OPS_FUNCTIONS = {
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async", "init", "join", "poll",
    "reducescatter", "reducescatter_async", "shutdown", "sparse_allreduce_async", "synchronize",
}  # fmt: skip


def test_every_horovod_torch_name_resolves() -> None:
    import shoal.torch.mpi_ops as mpi_ops

    assert HOROVOD_TORCH_NAMES - set(dir(hvd)) == set()
    assert HOROVOD_MPI_OPS_FUNCTIONS - set(dir(mpi_ops)) == set()
    assert mpi_ops.allreduce is hvd.allreduce and mpi_ops.HorovodInternalError is hvd.HorovodInternalError
