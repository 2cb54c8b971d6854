"""Imported first by a worker script here: Keras's two optional imports off.

Keras imports scikit-learn (for `keras.wrappers`) and matplotlib (for
`keras.visualization`) at start-up whenever they are installed, and the
test extra installs both (the demo's digits, the docs' figures). No worker
here uses either, and they cost 1.1-2.0 of the 4.5-5.6 CPU-seconds that
`import keras_mirror, tensorflow` takes on the 2-core test machine
(measured), in each of the ~40 worker processes a suite run starts. A
`None` in `sys.modules` makes them look absent, which Keras checks for.

Only the harness's own workers and the tests' own `python -c` processes
(`support.helpers.lean`) do this; the user-style scripts (`plain_train.py`,
`stock_fit.py`), the examples and the benchmarks start as users' code does.
"""

import sys

for _name in ("sklearn", "matplotlib"):
    sys.modules.setdefault(_name, None)
