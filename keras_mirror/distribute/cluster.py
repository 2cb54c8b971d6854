"""Parsing and validation of `TF_CONFIG`, the multi-worker cluster spec.

`TF_CONFIG` is the JSON document that `tf.distribute` reads to find the
other workers of a `MultiWorkerMirroredStrategy`:

```json
{"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
 "task": {"type": "worker", "index": 0}}
```

TensorFlow checks little of it and, given a typo, usually waits forever for
a peer that does not exist. `parse_cluster` checks it up front and names
what is wrong. Only the jobs that take part in synchronous training,
`"chief"` (at most one address) and `"worker"`, are accepted; the
top-level keys `"rpc_layer"` and `"environment"` are ignored, as in
TensorFlow. As in TensorFlow, a missing task `"index"` means 0.
"""

import dataclasses
import json
import os
import re
import socket

from keras_mirror import errors

_JOBS = ("chief", "worker")
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")
_EXPECTED = (
    'expected an object such as {"cluster": {"worker": ["host1:2222", '
    '"host2:2222"]}, "task": {"type": "worker", "index": 0}}.'
)


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """The validated cluster of a multi-worker run and this process's task.

    Args:
        workers: tuple of str. The `"host:port"` addresses of the `"worker"`
            job, in task-index order (may be empty when a chief is given).
        task_type: str. `"chief"` or `"worker"`: the job of this process.
        task_index: int. This process's index within its job.
        chief: str or `None`. The address of the `"chief"` task, if the
            cluster has one; default `None`.

    Example:

    ```python
    spec = keras_mirror.cluster.parse_cluster(
        {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
         "task": {"type": "worker", "index": 1}}
    )
    spec.num_workers, spec.is_chief, spec.address
    # (2, False, "127.0.0.1:2223")
    ```
    """

    workers: tuple
    task_type: str
    task_index: int
    chief: str | None = None

    @property
    def num_workers(self):
        """Number of training processes: the workers plus the chief."""
        return len(self.workers) + (self.chief is not None)

    @property
    def is_chief(self):
        """Whether this task saves checkpoints and writes summaries.

        That is the `"chief"` task, or worker 0 when there is no chief job,
        as in `tf.distribute`.
        """
        if self.chief is not None:
            return self.task_type == "chief"
        return self.task_index == 0

    @property
    def address(self):
        """This task's own `"host:port"` address."""
        if self.task_type == "chief":
            return self.chief
        return self.workers[self.task_index]


def _fail(name, path, value, problem):
    raise errors.ClusterConfigError(
        f"`{name}{path}` {problem} Received: {name}{path}={value!r}"
    )


def _load(value, name):
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            _fail(name, "", value, f"is not valid JSON ({e}); {_EXPECTED}")
    if not isinstance(value, dict):
        _fail(name, "", value, f"must be a JSON object; {_EXPECTED}")
    for key in ("cluster", "task"):
        if key not in value:
            _fail(name, "", value, f'has no "{key}" key; {_EXPECTED}')
    return value


def _check_address(address, name, path):
    match = _ADDRESS.match(address) if isinstance(address, str) else None
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        _fail(
            name,
            path,
            address,
            'must be a "host:port" address with a port from 1 to 65535, '
            'such as "10.0.0.1:2222".',
        )


def _jobs(cluster, name):
    path = "['cluster']"
    if not isinstance(cluster, dict) or not cluster:
        _fail(
            name,
            path,
            cluster,
            'must map the job names "chief" and/or "worker" to lists '
            'of addresses, such as {"worker": ["host1:2222", "host2:2222"]}.',
        )
    unknown = sorted(set(cluster) - set(_JOBS))
    if unknown:
        _fail(
            name,
            path,
            cluster,
            f"has the job(s) {unknown}; only the jobs of synchronous "
            'training, "chief" and "worker", are supported.',
        )
    jobs = {job: _job(cluster, job, name) for job in _JOBS if job in cluster}
    everything = [a for addresses in jobs.values() for a in addresses]
    duplicates = sorted({a for a in everything if everything.count(a) > 1})
    if duplicates:
        _fail(
            name,
            path,
            cluster,
            f"gives the address(es) {duplicates} to more than one task; "
            "every task needs its own host:port.",
        )
    return jobs


def _job(cluster, job, name):
    path = f"['cluster']['{job}']"
    addresses = cluster[job]
    if not isinstance(addresses, list) or not addresses:
        _fail(
            name,
            path,
            addresses,
            'must be a non-empty list of "host:port" addresses.',
        )
    if job == "chief" and len(addresses) != 1:
        _fail(name, path, addresses, "must have exactly one address.")
    for i, address in enumerate(addresses):
        _check_address(address, name, f"{path}[{i}]")
    return tuple(addresses)


def _task(task, jobs, name):
    if not isinstance(task, dict):
        _fail(
            name,
            "['task']",
            task,
            'must be an object such as {"type": "worker", "index": 0}.',
        )
    task_type = task.get("type")
    if task_type not in jobs:
        _fail(
            name,
            "['task']['type']",
            task_type,
            f"must name a job of the cluster, one of {sorted(jobs)}.",
        )
    index = task.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int):
        _fail(name, "['task']['index']", index, "must be an integer.")
    size = len(jobs[task_type])
    if not 0 <= index < size:
        _fail(
            name,
            "['task']['index']",
            index,
            f'must be in [0, {size}): the job "{task_type}" has {size} '
            "address(es).",
        )
    return task_type, index


def _parse(value, name):
    config = _load(value, name)
    jobs = _jobs(config["cluster"], name)
    task_type, task_index = _task(config["task"], jobs, name)
    chief = jobs["chief"][0] if "chief" in jobs else None
    return ClusterSpec(jobs.get("worker", ()), task_type, task_index, chief)


def parse_cluster(value):
    """Validates a cluster spec given as a `TF_CONFIG`-shaped dict or JSON.

    Args:
        value: dict or str. The cluster in `TF_CONFIG`'s shape, either as a
            dict or as its JSON text.

    Returns:
        A `ClusterSpec`, also for a one-task cluster.

    Raises:
        ClusterConfigError: if `value` is not valid JSON, not an object,
            lacks `"cluster"` or `"task"`, has an empty or malformed job,
            a malformed or duplicate `"host:port"` address, a task type
            that is not a job of the cluster, or a task index that is not
            an integer in range. The message names `cluster`.

    Example:

    ```python
    spec = keras_mirror.cluster.parse_cluster(
        '{"cluster": {"worker": ["127.0.0.1:2222"]}, '
        '"task": {"type": "worker", "index": 0}}'
    )
    ```
    """
    return _parse(value, "cluster")


def cluster_from_env(environ=None):
    """Reads and validates the `TF_CONFIG` environment variable.

    Returns `None` when `TF_CONFIG` is unset or blank, and also when it
    names a one-task cluster: with no peer to all-reduce with, the
    single-host `MirroredStrategy` is equivalent, needs no port, and is
    what keras-mirror uses. A one-task `TF_CONFIG` is still validated.

    Args:
        environ: mapping or `None`. Where to look up `TF_CONFIG`; default
            `os.environ`.

    Returns:
        A `ClusterSpec` for a cluster of two or more tasks, else `None`.

    Raises:
        ClusterConfigError: as `parse_cluster`, with messages that name
            `TF_CONFIG`.

    Example:

    ```python
    spec = keras_mirror.cluster.cluster_from_env()
    if spec is not None and spec.is_chief:
        print(f"chief of {spec.num_workers} workers at {spec.address}")
    ```
    """
    environ = os.environ if environ is None else environ
    text = environ.get("TF_CONFIG", "")
    if not text.strip():
        return None
    spec = _parse(text, "TF_CONFIG")
    return spec if spec.num_workers > 1 else None


def cluster_from_resolver(resolver):
    """Validates the cluster of a TensorFlow `ClusterResolver`.

    Accepts any `tf.distribute.cluster_resolver.ClusterResolver`:
    `TFConfigClusterResolver` (a Kubeflow `TFJob`'s `chief` + `worker`),
    `SlurmClusterResolver`, `SimpleClusterResolver`, and so on. Its
    `cluster_spec()`, `task_type` and `task_id` are checked as a
    `TF_CONFIG` would be.

    Args:
        resolver: a TensorFlow `ClusterResolver`.

    Returns:
        A `ClusterSpec`, also for a one-task cluster.

    Raises:
        ClusterConfigError: as `parse_cluster`; also when the resolver does
            not say which task this process is. The message names
            `cluster`.

    Example:

    ```python
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = keras_mirror.cluster.cluster_from_resolver(resolver)
    ```
    """
    jobs = resolver.cluster_spec().as_dict()
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type is None:
        raise errors.ClusterConfigError(
            f"`cluster` ({type(resolver).__name__}) does not say which "
            "task this process is (its "
            "`task_type` is None); pass `task_type=` and `task_id=` to the "
            f"resolver. Received: cluster={type(resolver).__name__}("
            f"cluster={jobs!r}, task_type={task_type!r}, "
            f"task_id={task_id!r})")
    value = {"cluster": {k: list(v) if isinstance(v, (list, tuple))
                         else [v[i] for i in sorted(v)]
                         for k, v in jobs.items()},
             "task": {"type": task_type, "index": int(task_id or 0)}}
    return _parse(value, "cluster")


def port_in_use(port):
    """Whether a TCP `port` cannot be bound on all interfaces right now.

    TensorFlow's gRPC server binds `0.0.0.0:port`; this tries the same
    bind (with `SO_REUSEADDR`, so that sockets in `TIME_WAIT` from an
    earlier run do not count) and releases it at once. The answer can be
    stale a moment later: another process may take the port in between.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False
