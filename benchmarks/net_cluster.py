"""A `MultiWorkerMirroredStrategy` cluster on emulated hosts, and its bytes.

Parent side: `run(net, argv_of, env, port, timeout, log)` starts worker
`i`'s command `argv_of(i)` inside host `i` of a `netns.Network`, with
`TF_CONFIG` naming every host's address at `port`, waits at most `timeout`
seconds and SIGKILLs every process group still running (on success too).

Worker side (no TensorFlow import here): `link_bytes()` reads this host's
`eth0` counters from sysfs (`ip netns exec` mounts the namespace's own
`/sys`), and `Meter()` is a Keras callback recording them at every
training batch's end and at each epoch's edges, so that bytes per step are
differences of consecutive readings. `idle(seconds)` measures the link's
bytes per second while this worker does nothing (the baseline).
"""

import json
import os
import signal
import subprocess
import time

STATS = "/sys/class/net/{dev}/statistics/{key}_bytes"


def tf_config(addresses, port, index):
    hosts = [f"{a}:{port}" for a in addresses]
    return json.dumps({"cluster": {"worker": hosts},
                       "task": {"type": "worker", "index": index}})


def run(net, argv_of, env, port, timeout, log):
    """Runs one worker per host; raises RuntimeError on a failure."""
    procs = []
    try:
        for i in range(net.n):
            procs.append(subprocess.Popen(
                net.command(i, argv_of(i)),
                env=dict(env, TF_CONFIG=tf_config(net.addresses, port, i)),
                stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(f"worker exit codes {codes}")
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"workers still running after {timeout} s") from e
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def log_tail(log, chars=3000):
    log.flush()
    with open(log.name) as f:
        return f.read()[-chars:]


def link_bytes(dev="eth0"):
    """`(rx, tx)` bytes of `dev` so far (its namespace's counters)."""
    out = []
    for key in ("rx", "tx"):
        with open(STATS.format(dev=dev, key=key)) as f:
            out.append(int(f.read()))
    return tuple(out)


def idle(seconds):
    """`(rx, tx)` bytes per second over `seconds` of doing nothing."""
    a = link_bytes()
    time.sleep(seconds)
    b = link_bytes()
    return tuple((y - x) / seconds for x, y in zip(a, b))


def Meter():
    """A Keras callback: `readings` = [(epoch, batch, t, rx, tx)] at each
    batch end, batch -1 at each epoch's start and -2 at its end."""
    import keras

    class _Meter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.readings = []
            self._epoch = 0

        def _read(self, batch):
            self.readings.append(
                (self._epoch, batch, time.perf_counter(), *link_bytes()))

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch
            self._read(-1)

        def on_train_batch_end(self, batch, logs=None):
            self._read(batch)

        def on_epoch_end(self, epoch, logs=None):
            self._read(-2)

    return _Meter()


def per_step(readings, epoch=None, skip=0):
    """`(ms, rx, tx)` of each step: differences of consecutive batch-end
    readings (of `epoch` if given), after the first `skip` steps."""
    ends = [r for r in readings if r[1] >= 0 and
            (epoch is None or r[0] == epoch)]
    steps = [(1000 * (b[2] - a[2]), b[3] - a[3], b[4] - a[4])
             for a, b in zip(ends, ends[1:]) if a[0] == b[0]]
    return steps[skip:]


def epoch_totals(readings, epoch):
    """`(steps, rx, tx)` from `epoch`'s start to its end (the end-of-data
    check included)."""
    start = next(r for r in readings if r[0] == epoch and r[1] == -1)
    end = next(r for r in readings if r[0] == epoch and r[1] == -2)
    steps = sum(1 for r in readings if r[0] == epoch and r[1] >= 0)
    return steps, end[3] - start[3], end[4] - start[4]
