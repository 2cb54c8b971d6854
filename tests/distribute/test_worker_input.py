"""`worker_input="shard"`: each worker reads only its rows, still exact.

Two workers x two logical CPUs train on 45 rows, global batch 8: each
global batch's split plan over 4 replicas is (2, 2, 2, 2), and the last
one of 5 rows (2, 1, 1, 1), so worker 0 reads 5 * 4 + 3 = 23 rows per
epoch and worker 1 reads 5 * 4 + 2 = 22: together the data once. The
weights equal single-device training.
"""

import re
import sys

import numpy as np
import pytest
from support.multi_worker import WORKER
from support.multi_worker import assert_equal_single_device
from support.multi_worker import no_leftover_processes  # noqa: F401
from support.multi_worker import worker_stub

from keras_mirror import launch as launch_lib
from keras_mirror.distribute import _worker_input


@pytest.mark.xdist_group("processes")
@pytest.mark.timeout(100)
def test_each_worker_reads_its_rows_and_trains_like_one_device(
        tmp_path, capsys):
    code = launch_lib.launch(
        [sys.executable, str(WORKER), str(tmp_path), "--epochs", "2",
         "--worker-input", "shard"], 2,
        timeout=80, start_timeout=45, grace_period=2)
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "input: every worker reads only its replicas' rows of each " \
        "global batch" in err
    read = re.findall(r"\[worker (\d)\] keras-mirror: worker (\d) read "
                      r"(\d+) of 45 rows \(epoch (\d)", err)
    assert sorted(read) == [("0", "0", "23", "1"), ("0", "0", "23", "2"),
                            ("1", "1", "22", "1"), ("1", "1", "22", "2")]
    gap = assert_equal_single_device(tmp_path)
    print("rows read per worker per epoch: 23 + 22 of 45; "
          f"max |w - w_single| = {gap:.3g}")


def test_segments_follow_the_split_plan_and_cover_every_row_once():
    parts = [_worker_input.segments(worker_stub(w), 45, 8) for w in (0, 1)]
    assert parts[0] == [(0, 4), (8, 12), (16, 20), (24, 28), (32, 36),
                        (40, 43)]
    assert parts[1] == [(4, 8), (12, 16), (20, 24), (28, 32), (36, 40),
                        (43, 45)]
    rows = sorted(r for p in parts for a, b in p for r in range(a, b))
    assert rows == list(range(45))


@pytest.mark.parametrize("kwargs, message", [
    ({"shuffle": True}, "`worker_input='shard'` needs `shuffle=False`: "
     "every worker must see the rows in the same order. Received: "
     "shuffle=True"),
    ({"shuffle": False, "validation_split": 0.2},
     "`worker_input='shard'` does not support `validation_split`; pass "
     "`validation_data`. Received: validation_split=0.2"),
])
def test_shard_refusals_name_the_argument(kwargs, message):
    x = np.zeros((10, 6), "float32")
    with pytest.raises(ValueError, match=re.escape(message)):
        _worker_input.shard_fit_input(worker_stub(0), x, x, 8, kwargs)


def test_shard_refuses_a_dataset():
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices(np.zeros((4, 2))).batch(2)
    with pytest.raises(ValueError, match=re.escape(
            "`worker_input='shard'` reads rows of arrays")):
        _worker_input.shard_fit_input(worker_stub(0), ds, None, None,
                                      {"shuffle": False})
