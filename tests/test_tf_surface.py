"""Horovod's TensorFlow and Keras surface where Shoal once differed, on 2 ranks: ``hvd.util``, ``broadcast_global_variables``
(eager and in a TF1 graph), the Keras collectives' return types on each backend and mode, the tape's
``get_local_and_global_gradients``, ``num_groups`` with ``groups`` (one rule on every front end), and one list reducer:
the same gradients through the tape's, the Keras optimizer's and the torch adapter's give the same values."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import numpy as np
import pytest

from conftest import keras_collectives
from shoal.testing import run_ranks

# Checked without importing: a rank unpickling a test function imports this module before it sets KERAS_BACKEND.
if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("TensorFlow is not installed (pip install 'shoal[tensorflow]')", allow_module_level=True)

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"}
TOLERANCE = 1e-6


def _util_and_global_variables(tf: Any, hvd: Any, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {"eager": hvd.util._executing_eagerly()}
    out["in_function"] = bool(tf.function(lambda: tf.constant(hvd.util._executing_eagerly()))())
    calls: list[int] = []
    cached = hvd.util._cache(lambda x: calls.append(x) or x * 2)
    out["cache"] = [cached(3), cached(3), len(calls)]
    variables = [tf.Variable(1.0), tf.Variable(2.0)]
    refs = hvd.util.vars_to_refs([variables, variables[:1]])
    back = hvd.util.refs_to_vars(refs)
    out["refs"] = [[v is w for v, w in zip(g, o, strict=True)] for g, o in zip(back, [variables, variables[:1]], strict=True)]
    out["subgraph"] = float(hvd.util._make_subgraph(lambda: tf.constant(5.0))())
    try:
        hvd.broadcast_global_variables(0)
        out["eager_broadcast_global"] = "none"
    except RuntimeError as error:
        out["eager_broadcast_global"] = str(error)
    graph = tf.Graph()
    with graph.as_default():
        first = tf.compat.v1.Variable([1.0, 2.0 + rank])
        second = tf.compat.v1.Variable(10.0 * (rank + 1), use_resource=True)
        op = hvd.broadcast_global_variables(1)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(op)
            out["graph_broadcast_global"] = [session.run(first).tolist(), float(session.run(second))]
    return out


def _keras_collectives(tf: Any, hvd_keras: Any, rank: int) -> dict[str, Any]:
    results = keras_collectives(hvd_keras, rank, "k")
    return {
        name: [type(result).__module__ + "." + type(result).__name__, result.numpy().tolist()]
        for name, result in results.items()
    }


def _tape_local_and_global(tf: Any, hvd: Any, rank: int) -> dict[str, Any]:
    import keras

    tf.random.set_seed(0)
    shared, local = keras.layers.Dense(2), keras.layers.Dense(1)
    x = tf.constant(np.arange(6.0, dtype=np.float32).reshape(2, 3) + rank)
    with tf.GradientTape(persistent=True) as plain:
        loss = tf.reduce_sum(local(shared(x)))
    sources = shared.trainable_weights + local.trainable_weights
    own = plain.gradient(loss, sources)
    tape = hvd.PartialDistributedGradientTape(plain, local_layers=local)
    local_pairs, global_pairs = tape.get_local_and_global_gradients(loss, sources)
    everyone = [hvd.allreduce(g, op=hvd.Average) for g in own]
    return {
        "local_sources": [p[0] is s for p, s in zip(local_pairs, local.trainable_weights, strict=True)],
        "global_sources": [p[0] is s for p, s in zip(global_pairs, shared.trainable_weights, strict=True)],
        "local_error": max(float(tf.reduce_max(tf.abs(p[1] - g / 2))) for p, g in zip(local_pairs, own[2:], strict=True)),
        "global_error": max(float(tf.reduce_max(tf.abs(p[1] - g))) for p, g in zip(global_pairs, everyone[:2], strict=True)),
    }


def _groups_rule(tf: Any, hvd: Any) -> dict[str, Any]:
    import torch

    import shoal.torch as hvd_torch
    from shoal.torch.optimizer import exchange_of

    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tape = hvd.DistributedGradientTape(tf.GradientTape(), num_groups=2, groups=1)
        out["tape_groups"] = tape._shoal_reducer.groups
        params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))]
        optimizer = hvd_torch.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), num_groups=2, groups=[[params[0]]])
        chosen = exchange_of(optimizer).buckets.groups
        out["torch_groups"] = [[id(p) for p in group] for group in chosen] == [[id(params[0])]]
    out["warnings"] = sorted({w.category.__name__ for w in caught if "num_groups" in str(w.message)})
    for label, make in (
        ("tape_negative", lambda: hvd.DistributedGradientTape(tf.GradientTape(), num_groups=-1)),
        ("tape_bad_groups", lambda: hvd.DistributedGradientTape(tf.GradientTape(), groups="two")),
        ("torch_bad_groups", lambda: hvd_torch.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), groups=0)),
    ):
        try:
            make()
            out[label] = "none"
        except ValueError as error:
            out[label] = str(error)
    return out


def _one_list_reducer(tf: Any, hvd: Any, rank: int) -> dict[str, Any]:
    """The same gradients (a dense one, a sparse one, a local one, a missing one) through the tape's, the Keras
    optimizer's and the torch adapter's reducer, with groups and sparse_as_dense."""
    import keras
    import torch

    import shoal.tensorflow.keras as hvd_keras
    from shoal.core.gradient_lists import GradientOptions, ListReducer
    from shoal.keras.optimizer import TorchListAdapter

    dense = np.arange(6.0, dtype=np.float32).reshape(3, 2) + 10 * rank
    rows, values = np.array([0, 2]), np.full((2, 2), 1.0 + rank, dtype=np.float32)
    own = np.full((2,), 4.0 + rank, dtype=np.float32)
    variables = [tf.Variable(np.zeros((3, 2), np.float32)), tf.Variable(np.zeros((3, 2), np.float32))]
    variables += [tf.Variable(np.zeros(2, np.float32)), tf.Variable(np.zeros(2, np.float32))]
    tf_grads = [tf.constant(dense), tf.IndexedSlices(tf.constant(values), tf.constant(rows), tf.constant([3, 2]))]
    tf_grads += [tf.constant(own), None]
    groups = [[variables[0], variables[1]]]

    tape = hvd.DistributedGradientTape(tf.GradientTape(), groups=groups, sparse_as_dense=True)
    tape.register_local_source(variables[2])
    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(), groups=groups, sparse_as_dense=True)
    optimizer.register_local_var(variables[2])
    params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(3, 2))]
    params += [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    options = GradientOptions.parse(hvd.Average, groups=[[params[0], params[1]]], sparse_as_dense=True)
    on_torch = ListReducer(options, TorchListAdapter(None))
    on_torch.register_local_source(params[2])
    sparse = torch.sparse_coo_tensor(torch.tensor(rows).reshape(1, 2), torch.tensor(values), (3, 2))
    torch_grads = [torch.tensor(dense), sparse, torch.tensor(own), None]

    def plain(result: list[Any]) -> list[Any]:
        return [None if g is None else np.asarray(g).tolist() for g in result]

    return {
        "tape": plain(tape._shoal_reducer.reduce(tf_grads, variables)),
        "keras": plain(optimizer._shoal_reducer.reduce(tf_grads, variables)),
        "torch": plain(on_torch.reduce(torch_grads, params)),
    }


def _surface() -> dict[str, Any]:
    import tensorflow as tf
    import torch

    import shoal.tensorflow as hvd
    import shoal.tensorflow.keras as hvd_keras

    torch.set_num_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    rank = hvd.rank()
    return {
        "util": _util_and_global_variables(tf, hvd, rank),
        "keras": _keras_collectives(tf, hvd_keras, rank),
        "tape": _tape_local_and_global(tf, hvd, rank),
        "groups": _groups_rule(tf, hvd),
        "one_reducer": _one_list_reducer(tf, hvd, rank),
    }


KERAS_VALUES = {
    "allreduce": [[0.5, 1.5], [2.5, 3.5]],  # the average of rank 0's and rank 1's values
    "allgather": [[0.0, 1.0], [2.0, 3.0], [1.0, 2.0], [3.0, 4.0]],
    "broadcast": [[1.0, 2.0], [3.0, 4.0]],
}
"""What each rank gets; reducescatter: rank r gets row r of the sum, [[1, 3], [5, 7]]."""


def _check_keras(result: dict[str, Any], rank: int, tensor_type: str) -> None:
    for name, (kind, values) in result.items():
        assert kind == tensor_type, (name, kind)
        want = [[[1.0, 3.0], [5.0, 7.0]][rank]] if name == "reducescatter" else KERAS_VALUES[name]
        assert np.allclose(values, want), (name, values, want)


@pytest.mark.timeout(180)
def test_util_global_variables_keras_returns_tape_pairs_and_groups_on_two_ranks() -> None:
    results = run_ranks(_surface, 2, timeout_s=150, env=ENV)
    for rank, result in enumerate(results):
        util = result["util"]
        assert util["eager"] is True and util["in_function"] is False
        assert util["cache"] == [6, 6, 1] and util["refs"] == [[True, True], [True]] and util["subgraph"] == 5.0
        assert "does not support eager execution" in util["eager_broadcast_global"]
        assert util["graph_broadcast_global"] == [[1.0, 3.0], 20.0], "rank 1's global variables on every rank"
        _check_keras(result["keras"], rank, "tensorflow.python.framework.ops.EagerTensor")
        tape = result["tape"]
        assert all(tape["local_sources"]) and len(tape["local_sources"]) == 2
        assert all(tape["global_sources"]) and len(tape["global_sources"]) == 2
        assert tape["local_error"] < TOLERANCE and tape["global_error"] < TOLERANCE, tape
        groups = result["groups"]
        assert groups["tape_groups"] == 1 and groups["torch_groups"] is True, "groups wins over num_groups"
        assert groups["warnings"] == ["DeprecationWarning"]
        assert "num_groups must be an int >= 0" in groups["tape_negative"]
        assert "groups must be an int > 0 or a list of lists" in groups["tape_bad_groups"]
        assert "groups must be an int > 0 or a list of lists" in groups["torch_bad_groups"]
        # Averaged over the 2 ranks: the dense gradient, the sparse one made dense; the local one divided by 2.
        want = [
            (np.arange(6.0).reshape(3, 2) + 5).tolist(),
            [[1.5, 1.5], [0.0, 0.0], [1.5, 1.5]],
            [(4.0 + rank) / 2] * 2,
            None,
        ]
        for adapter, got in result["one_reducer"].items():
            assert got[3] is None, adapter
            for index in range(3):
                assert np.allclose(got[index], want[index], atol=TOLERANCE), (adapter, index, got[index])


def _keras_on_torch() -> dict[str, Any]:
    import torch

    import shoal.keras as hvd_keras

    torch.set_num_threads(1)
    hvd_keras.init()
    results = keras_collectives(hvd_keras, hvd_keras.rank(), "k")
    out = {name: [type(r).__module__ + "." + type(r).__name__, r.numpy().tolist()] for name, r in results.items()}
    try:
        hvd_keras.broadcast_global_variables(0)
        out["broadcast_global_variables"] = "none"
    except RuntimeError as error:
        out["broadcast_global_variables"] = str(error)
    return out


@pytest.mark.timeout(120)
def test_keras_collectives_on_the_torch_backend_return_torch_tensors() -> None:
    # fresh: the forked ranks have TensorFlow's Keras loaded already (conftest)
    results = run_ranks(_keras_on_torch, 2, timeout_s=100, env={**ENV, "KERAS_BACKEND": "torch"}, fresh=True)
    for rank, result in enumerate(results):
        assert "TF1 graph-mode helper" in result.pop("broadcast_global_variables")
        _check_keras(result, rank, "torch.Tensor")


def _before_init() -> dict[str, str]:
    """What a collective raises before ``init()``, eagerly, in a tf.function and in a v1 session."""
    import tensorflow as tf

    import shoal.tensorflow as hvd

    def eager() -> Any:
        return hvd.allreduce(tf.constant([1.0]))

    def compiled() -> Any:
        return tf.function(lambda x: hvd.allreduce(x))(tf.constant([1.0]))

    def session() -> Any:
        graph = tf.Graph()
        with graph.as_default(), tf.compat.v1.Session(graph=graph) as running:
            return running.run(hvd.allreduce(tf.constant([1.0])))

    out = {}
    for mode, call in (("eager", eager), ("tf_function", compiled), ("tf_v1_graph", session)):
        try:
            call()
            out[mode] = "none"
        except Exception as error:
            out[mode] = type(error).__name__
    return out


@pytest.mark.timeout(120)
def test_use_before_init_is_horovods_failed_precondition_in_every_mode() -> None:
    """Horovod's TensorFlow ops report use before init() as a precondition error (its CheckInitialized)."""
    (result,) = run_ranks(_before_init, 1, env=ENV, timeout_s=100)
    assert result == dict.fromkeys(("eager", "tf_function", "tf_v1_graph"), "FailedPreconditionError"), result


def _broken_job() -> dict[str, Any]:
    """A collective of a broken job (here: the request layer raises HorovodInternalError, as when a peer died) in each
    mode; and what elastic training's ``surfacing`` makes of it."""
    import tensorflow as tf

    import shoal.tensorflow as hvd
    from shoal.core import requests
    from shoal.exceptions import HorovodInternalError
    from shoal.tf_ops.errors import surfacing

    hvd.init()

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise HorovodInternalError("peer 1 died")

    requests.run = broken  # (this rank's process only; it ends with the test)

    def session() -> Any:
        graph = tf.Graph()
        with graph.as_default(), tf.compat.v1.Session(graph=graph) as running:
            return running.run(hvd.allreduce(tf.constant([1.0])))

    modes = {
        "eager": lambda: hvd.allreduce(tf.constant([1.0])),
        "tf_function": lambda: tf.function(lambda x: hvd.allreduce(x))(tf.constant([1.0])),
        "tf_v1_graph": session,
    }
    out: dict[str, Any] = {}
    for mode, call in modes.items():
        try:
            call()
            out[mode] = "none"
        except Exception as error:
            out[mode] = [type(error).__name__, "HorovodInternalError: peer 1 died" in str(error)]
        try:
            surfacing(call)()
        except HorovodInternalError as error:
            out[f"{mode}/surfaced"] = str(error)
        except Exception as error:
            out[f"{mode}/surfaced"] = f"not surfaced: {type(error).__name__}"
    return out


@pytest.mark.timeout(120)
def test_a_broken_job_is_an_unknown_error_in_every_mode_that_elastic_training_recognises() -> None:
    """Horovod's TensorFlow ops report a broken job as UnknownError eagerly and in a graph; its elastic.run turns it
    into HorovodInternalError (restore and re-form). Shoal's do the same."""
    (result,) = run_ranks(_broken_job, 1, env=ENV, timeout_s=100)
    for mode in ("eager", "tf_function", "tf_v1_graph"):
        assert result[mode] == ["UnknownError", True], (mode, result[mode])
        assert result[f"{mode}/surfaced"] == "peer 1 died", (mode, result)
