"""Tests of `keras_mirror.cluster`: parsing and validating `TF_CONFIG`."""

import dataclasses
import json
import re
import socket

import pytest

from keras_mirror import cluster as cluster_lib
from keras_mirror import errors

TWO = ["127.0.0.1:2222", "127.0.0.1:2223"]
EXPECTED = (
    'expected an object such as {"cluster": {"worker": ["host1:2222", '
    '"host2:2222"]}, "task": {"type": "worker", "index": 0}}.'
)


def _config(workers=TWO, task_type="worker", index=0, **jobs):
    return {
        "cluster": {"worker": workers, **jobs},
        "task": {"type": task_type, "index": index},
    }


def _env(config):
    return {"TF_CONFIG": json.dumps(config)}


def test_parse_workers():
    spec = cluster_lib.parse_cluster(_config(index=1))
    assert spec == cluster_lib.ClusterSpec(tuple(TWO), "worker", 1)
    assert spec.num_workers == 2
    assert not spec.is_chief
    assert spec.address == "127.0.0.1:2223"


def test_worker_0_is_chief_without_chief_job():
    spec = cluster_lib.parse_cluster(_config(index=0))
    assert spec.is_chief


def test_chief_job():
    config = _config(task_type="chief", chief=["10.0.0.9:2000"])
    spec = cluster_lib.parse_cluster(config)
    assert spec.chief == "10.0.0.9:2000"
    assert spec.num_workers == 3
    assert spec.is_chief
    assert spec.address == "10.0.0.9:2000"
    worker_0 = cluster_lib.parse_cluster(
        _config(index=0, chief=["10.0.0.9:2000"])
    )
    assert not worker_0.is_chief
    assert worker_0.address == TWO[0]


def test_chief_only_cluster():
    config = {"cluster": {"chief": ["h:1"]}, "task": {"type": "chief"}}
    spec = cluster_lib.parse_cluster(config)
    assert (spec.workers, spec.num_workers, spec.is_chief) == ((), 1, True)


def test_json_text_hostnames_ipv6_and_default_index():
    text = json.dumps(
        {
            "cluster": {"worker": ["worker-0.svc.local:2222", "[::1]:2223"]},
            "task": {"type": "worker"},
            "rpc_layer": "grpc",
        }
    )
    spec = cluster_lib.parse_cluster(text)
    assert spec.task_index == 0
    assert spec.workers == ("worker-0.svc.local:2222", "[::1]:2223")


def test_spec_is_frozen():
    spec = cluster_lib.parse_cluster(_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.task_index = 1


@pytest.mark.parametrize("environ", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": " "}])
def test_cluster_from_env_unset_or_blank(environ):
    assert cluster_lib.cluster_from_env(environ) is None


def test_cluster_from_env_single_task_is_none_but_validated():
    assert cluster_lib.cluster_from_env(_env(_config(TWO[:1]))) is None
    with pytest.raises(errors.ClusterConfigError, match="TF_CONFIG"):
        cluster_lib.cluster_from_env(_env(_config(TWO[:1], index=1)))


def test_cluster_from_env(monkeypatch):
    environ = _env(_config(index=1))
    assert cluster_lib.cluster_from_env(environ).address == TWO[1]
    monkeypatch.setenv("TF_CONFIG", environ["TF_CONFIG"])
    assert cluster_lib.cluster_from_env().task_index == 1


BAD = [
    (
        "{not json",
        "",
        "is not valid JSON (Expecting property name enclosed in double "
        f"quotes: line 1 column 2 (char 1)); {EXPECTED}",
        "'{not json'",
    ),
    (["worker"], "", f"must be a JSON object; {EXPECTED}", "['worker']"),
    (
        {"task": {"type": "worker"}},
        "",
        f'has no "cluster" key; {EXPECTED}',
        "{'task': {'type': 'worker'}}",
    ),
    (
        {"cluster": {"worker": TWO}},
        "",
        f'has no "task" key; {EXPECTED}',
        "{'cluster': {'worker': ['127.0.0.1:2222', '127.0.0.1:2223']}}",
    ),
    (
        {"cluster": {}, "task": {}},
        "['cluster']",
        'must map the job names "chief" and/or "worker" to lists of '
        'addresses, such as {"worker": ["host1:2222", "host2:2222"]}.',
        "{}",
    ),
    (
        _config(ps=["h:1"]),
        "['cluster']",
        "has the job(s) ['ps']; only the jobs of synchronous training, "
        '"chief" and "worker", are supported.',
        "{'worker': ['127.0.0.1:2222', '127.0.0.1:2223'], 'ps': ['h:1']}",
    ),
    (
        _config(task_type="ps"),
        "['task']['type']",
        "must name a job of the cluster, one of ['worker'].",
        "'ps'",
    ),
    (
        {"cluster": {"worker": TWO}, "task": "worker"},
        "['task']",
        'must be an object such as {"type": "worker", "index": 0}.',
        "'worker'",
    ),
    (
        _config(index=2),
        "['task']['index']",
        'must be in [0, 2): the job "worker" has 2 address(es).',
        "2",
    ),
    (
        _config(index=-1),
        "['task']['index']",
        'must be in [0, 2): the job "worker" has 2 address(es).',
        "-1",
    ),
    (_config(index="1"), "['task']['index']", "must be an integer.", "'1'"),
    (_config(index=True), "['task']['index']", "must be an integer.", "True"),
    (
        _config([]),
        "['cluster']['worker']",
        'must be a non-empty list of "host:port" addresses.',
        "[]",
    ),
    (
        _config("127.0.0.1:2222"),
        "['cluster']['worker']",
        'must be a non-empty list of "host:port" addresses.',
        "'127.0.0.1:2222'",
    ),
    (
        _config(chief=["a:1", "b:2"]),
        "['cluster']['chief']",
        "must have exactly one address.",
        "['a:1', 'b:2']",
    ),
    *[
        (
            _config(["127.0.0.1:2222", bad]),
            "['cluster']['worker'][1]",
            'must be a "host:port" address with a port from 1 to 65535, '
            'such as "10.0.0.1:2222".',
            repr(bad),
        )
        for bad in ["127.0.0.1", "127.0.0.1:", ":2222", "h:0", "h:65536"]
        + ["h:22x", "a b:1", "h:1:2", 2222]
    ],
    (
        _config(["h:1", "h:2", "h:1"]),
        "['cluster']",
        "gives the address(es) ['h:1'] to more than one task; every task "
        "needs its own host:port.",
        "{'worker': ['h:1', 'h:2', 'h:1']}",
    ),
    (
        _config(["h:1"], chief=["h:1"]),
        "['cluster']",
        "gives the address(es) ['h:1'] to more than one task; every task "
        "needs its own host:port.",
        "{'worker': ['h:1'], 'chief': ['h:1']}",
    ),
]


@pytest.mark.parametrize("value, path, problem, received", BAD)
def test_parse_cluster_errors(value, path, problem, received):
    message = re.escape(
        f"`cluster{path}` {problem} Received: cluster{path}={received}"
    )
    with pytest.raises(errors.ClusterConfigError, match=f"^{message}$"):
        cluster_lib.parse_cluster(value)


def test_tf_config_errors_name_tf_config():
    # One test for all cases: the conftest's per-test teardown is not free.
    for value, path, problem, received in BAD:
        text = value if isinstance(value, str) else json.dumps(value)
        message = re.escape(
            f"`TF_CONFIG{path}` {problem} Received: TF_CONFIG{path}={received}"
        )
        with pytest.raises(errors.ClusterConfigError, match=f"^{message}$"):
            cluster_lib.cluster_from_env({"TF_CONFIG": text})


def test_errors_are_value_errors():
    with pytest.raises(ValueError):
        cluster_lib.parse_cluster("[]")


@pytest.mark.xdist_group("processes")
def test_port_in_use():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert cluster_lib.port_in_use(port)
    assert not cluster_lib.port_in_use(port)


# -- TensorFlow's cluster resolvers (`cluster=`, `keras_mirror.init`) -------

# The environment `srun -N 2 --ntasks-per-node 2 python train.py` gives
# task 1 (second task of node001) on a CPU-only cluster.
SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "node[001-002]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "4",
    "SLURM_NPROCS": "4",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "node[001-002]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURMD_NODENAME": "node001",
    "SLURM_CPUS_ON_NODE": "8",
}


@pytest.fixture
def slurm(monkeypatch):
    for key in list(__import__("os").environ):
        if key.startswith("SLURM") or key in ("TF_CONFIG",
                                               "CUDA_VISIBLE_DEVICES"):
            monkeypatch.delenv(key)
    for key, value in SLURM_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("shutil.which", lambda name: None)  # no nvidia-smi


def test_srun_step_is_a_cluster_from_the_environment(slurm):
    from keras_mirror.distribute import _multi_worker

    spec, source = _multi_worker.cluster_from_environment()
    assert source == "Slurm"
    assert spec == cluster_lib.ClusterSpec(
        workers=("node001:8888", "node001:8889", "node002:8888",
                 "node002:8889"),
        task_type="worker", task_index=1)
    assert not spec.is_chief and spec.address == "node001:8889"


def test_slurm_resolver_is_accepted_as_cluster(slurm):
    import tensorflow as tf

    from keras_mirror.distribute import _multi_worker

    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
        port_base=23456, gpus_per_node=2, gpus_per_task=1,
        auto_set_gpu=False)
    spec = _multi_worker.cluster_spec(resolver)
    assert spec.workers == ("node001:23456", "node001:23457",
                            "node002:23456", "node002:23457")
    assert (spec.task_type, spec.task_index) == ("worker", 1)


def test_batch_script_outside_srun_is_not_a_cluster(slurm, monkeypatch):
    from keras_mirror.distribute import _multi_worker

    monkeypatch.delenv("SLURM_STEP_ID")
    assert _multi_worker.cluster_from_environment() == (None, None)


KUBEFLOW_TF_CONFIG = {
    "cluster": {
        "chief": ["mnist-chief-0.kubeflow.svc:2222"],
        "worker": ["mnist-worker-0.kubeflow.svc:2222",
                   "mnist-worker-1.kubeflow.svc:2222"],
    },
    "task": {"type": "worker", "index": 1},
    "environment": "cloud",
}


def test_kubeflow_tfjob_through_tf_config_resolver(monkeypatch):
    import tensorflow as tf

    from keras_mirror.distribute import _multi_worker

    monkeypatch.setenv("TF_CONFIG", json.dumps(KUBEFLOW_TF_CONFIG))
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = _multi_worker.cluster_spec(resolver)
    assert spec == cluster_lib.cluster_from_env()
    assert spec.chief == "mnist-chief-0.kubeflow.svc:2222"
    assert (spec.num_workers, spec.is_chief) == (3, False)
    assert _multi_worker.worker_position(spec) == 2


def test_resolver_without_a_task_names_what_to_pass():
    import tensorflow as tf

    from keras_mirror.distribute import _multi_worker

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": TWO}))
    with pytest.raises(errors.ClusterConfigError, match=re.escape(
            "`cluster` (SimpleClusterResolver) does not say which task this "
            "process is (its `task_type` is None); pass `task_type=` and "
            "`task_id=` to the resolver. Received: cluster=")):
        _multi_worker.cluster_spec(resolver)


def test_resolver_with_a_parameter_server_keeps_the_clear_error():
    import tensorflow as tf

    from keras_mirror.distribute import _multi_worker

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": TWO, "ps": ["127.0.0.1:2224"]}),
        task_type="worker", task_id=0)
    with pytest.raises(errors.ClusterConfigError, match=re.escape(
            "has the job(s) ['ps']; only the jobs of synchronous training")):
        _multi_worker.cluster_spec(resolver)
