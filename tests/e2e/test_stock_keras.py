"""Stock Keras under MirroredStrategy next to keras-mirror, on the same data.

Stock `fit` averages the replicas' local means, so a last batch split
unevenly (here 1025 rows, batch 64, 4 replicas: the last batch of 1 row is
split 1/0/0/0) either moves the weights away from single-device training
or, on some runs, aborts the collective all-reduce ("Shape mismatch in the
collective instance ...", seen in CI) because the replica with no rows
packs its gradients differently. Which of the two happens depends on timing
inside TF. Both are failures of stock Keras; the test accepts either and
prints which one it saw. The stock run is in its own process (stock_fit.py)
because a collective abort poisons the process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
from support import stock_fit
from support.helpers import max_diff

import keras_mirror


def _run_stock(tmp_path):
    weights = tmp_path / "stock.npz"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    script = Path(stock_fit.__file__)
    done = subprocess.run([sys.executable, str(script), str(weights)],
                          capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    if outcome["error"] is not None:
        return outcome["error"], None
    with np.load(weights) as arrays:
        return None, [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def test_stock_partial_batch_error_next_to_keras_mirror(cpus, tmp_path):
    x, y = stock_fit.data()
    kwargs = dict(batch_size=stock_fit.BATCH, epochs=1, shuffle=False,
                  verbose=0)

    reference = stock_fit.model()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.fit(x, y, **kwargs)

    stock_failure, stock_weights = _run_stock(tmp_path)

    mirrored = keras_mirror.MirroredModel(stock_fit.model(), devices=cpus)
    mirrored.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    mirrored.fit(x, y, **kwargs)
    ours = max_diff(reference.get_weights(), mirrored.model.get_weights())

    if stock_failure is not None:
        print(f"stock aborted: {stock_failure}; keras-mirror error {ours:.3g}")
        assert "collective" in stock_failure.lower()
    else:
        stock_error = max_diff(reference.get_weights(), stock_weights)
        print(f"stock error {stock_error:.4g}, keras-mirror error {ours:.3g}")
        assert stock_error > 1e-2
    assert ours < 1e-5
