# ruff: noqa: E501, E741
"""Which shard shapes make TensorFlow's oneDNN CPU kernels fail? (issue 26, section 2;
issue 37: the conv matrix, `conv-matrix`, strides/kernels/padding/sizes/rows)

Plain Keras, one device, no keras_mirror.  Every case (layer kind x rows x
channels) runs in its own child process, so a SIGABRT/SIGSEGV only kills that
case.  A case builds a tiny model around the layer under test, then runs its
stages and prints one JSON line per stage:

  tob  -- `model.train_on_batch(x, y)` 3 times with `rows` rows
  mix  -- (optional) train_on_batch alternating 8 rows and `rows` rows, 3 times,
          then fit() on 16 + rows samples with batch_size=8 (last batch = rows)
  fwd  -- forward only (training=True) in a `tf.function`; checks output shapes
  fn   -- forward (training=True) + gradient of the model in a `tf.function`,
          what a replica with that shard does; checks the shape of the tested
          layer's output, of the model output and of every gradient.

Rows > 0 run "tob,fwd,fn" in one child.  Rows == 0 run "fwd,fn" and "tob" in two
separate children (so a crash in one does not hide the other).

Usage (driver):
  python shard_shapes.py run [--kinds a,b] [--rows 0,1] [--channels 1,3]
                             [--repeat N] [--onednn-off] [--out results.jsonl]
  python shard_shapes.py rerun-failures   # each failing case 3x on, 3x oneDNN off
  python shard_shapes.py report           # writes results.md from the jsonl files
  python shard_shapes.py conv-matrix --part core|variants|edge|resnet
                          [--repeat N] [--onednn-off]   # issue 37: Conv2D
  python shard_shapes.py conv-off [--repeat N]  # its failures, oneDNN off
  python shard_shapes.py conv-report    # conv_matrix.md and conv_matrix.json
Child (internal):
  python shard_shapes.py case KIND ROWS CHANNELS STAGES
"""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "shard_shapes"
)
PYTHON = sys.executable
TIMEOUT = 60
PARALLEL = 2

ROWS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 16)
CHANNELS = (1, 3, 8, 19)
# The 2 shared cores only allow ~500 children before the deadline, so: the
# kinds the issue saw abort (BN, residual blocks, Conv2D) get all four channel
# counts; the other convolutions/pools get two; features/embedding width of the
# non-image kinds is not what the issue is about and gets one.
FULL_CHANNEL_KINDS = {
    "bn_conv2d",
    "syncbn_conv2d",
    "resblock",
    "resblock_sync",
    "conv2d",
}
SMALL_CHANNELS = (3, 19)
NON_IMAGE_CHANNELS = (3,)
KINDS = (
    # most relevant first: the ones the issue saw abort
    "bn_conv2d",
    "syncbn_conv2d",
    "resblock",
    "resblock_sync",
    "conv2d",
    "conv2d_transpose",
    "depthwise_conv2d",
    "separable_conv2d",
    "conv1d",
    "conv3d",
    "maxpool2d",
    "avgpool2d",
    "bn_dense",
    "layernorm",
    "lstm",
    "gru",
    "mha",
    "embedding",
)
NON_IMAGE = {"bn_dense", "layernorm", "lstm", "gru", "mha", "embedding"}
# Larger, keras.io-style models (not in the default matrix; `--kinds` them):
# channels = input image channels.
EXAMPLE_KINDS = ("mnist_convnet", "convnet32_bn", "resnet32_sync", "resnet32")


# --------------------------------------------------------------------------
# child side
# --------------------------------------------------------------------------
def build(kind, c):
    """Return (inputs, tested_layer_output, model_output, input_spec)."""
    import keras
    from keras import layers

    def head(t):
        if len(t.shape) > 2:
            t = layers.Flatten()(t)
        return layers.Dense(1)(t)

    def res(x, sync):
        a = layers.Conv2D(8, 3, padding="same")(x)
        a = layers.BatchNormalization(synchronized=sync)(a)
        a = layers.ReLU()(a)
        a = layers.Conv2D(8, 3, padding="same")(a)
        a = layers.BatchNormalization(synchronized=sync)(a)
        s = layers.Conv2D(8, 1)(x)
        s = layers.BatchNormalization(synchronized=sync)(s)
        k = layers.Add()([a, s])
        t = layers.ReLU()(k)
        t = layers.GlobalAveragePooling2D()(t)
        return k, layers.Dense(1)(t)

    ishape, dtype = (8, 8, c), "float32"
    if kind.startswith("c2d-"):  # the conv matrix (issue 37): see conv_kind
        return build_conv(kind, c)
    if kind in ("resnet12", "resnet12_sync"):  # issue 37's ResNet
        inp, out = resnet12(c, kind == "resnet12_sync")
        return inp, out, out, ((12, 12, c), "float32")
    if kind == "conv2d":
        inp = keras.Input(ishape)
        k = layers.Conv2D(5, 3, padding="same")(inp)
        out = head(layers.ReLU()(k))
    elif kind == "conv1d":
        ishape = (8, c)
        inp = keras.Input(ishape)
        k = layers.Conv1D(5, 3, padding="same")(inp)
        out = head(layers.ReLU()(k))
    elif kind == "conv3d":
        ishape = (4, 4, 4, c)
        inp = keras.Input(ishape)
        k = layers.Conv3D(5, 3, padding="same")(inp)
        out = head(layers.ReLU()(k))
    elif kind == "conv2d_transpose":
        inp = keras.Input(ishape)
        k = layers.Conv2DTranspose(5, 3, strides=2, padding="same")(inp)
        out = head(layers.ReLU()(k))
    elif kind == "depthwise_conv2d":
        inp = keras.Input(ishape)
        k = layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same")(inp)
        out = head(layers.ReLU()(k))
    elif kind == "separable_conv2d":
        inp = keras.Input(ishape)
        k = layers.SeparableConv2D(5, 3, padding="same")(inp)
        out = head(layers.ReLU()(k))
    elif kind in ("bn_conv2d", "syncbn_conv2d"):
        ishape = (8, 8, 3)
        inp = keras.Input(ishape)
        t = layers.Conv2D(c, 3, padding="same")(inp)
        k = layers.BatchNormalization(synchronized=kind == "syncbn_conv2d")(t)
        out = head(layers.ReLU()(k))
    elif kind in ("resblock", "resblock_sync"):
        inp = keras.Input(ishape)
        k, out = res(inp, kind == "resblock_sync")
    elif kind in ("maxpool2d", "avgpool2d"):
        ishape = (8, 8, 3)
        inp = keras.Input(ishape)
        t = layers.Conv2D(c, 1)(inp)
        pool = (
            layers.MaxPooling2D
            if kind == "maxpool2d"
            else layers.AveragePooling2D
        )
        k = pool(2)(t)
        out = head(k)
    elif kind == "bn_dense":
        ishape = (4,)
        inp = keras.Input(ishape)
        t = layers.Dense(c)(inp)
        k = layers.BatchNormalization()(t)
        out = head(layers.ReLU()(k))
    elif kind == "layernorm":
        ishape = (6, c)
        inp = keras.Input(ishape)
        k = layers.LayerNormalization()(inp)
        out = head(layers.Dense(4)(k))
    elif kind in ("lstm", "gru"):
        ishape = (6, c)
        inp = keras.Input(ishape)
        k = (layers.LSTM if kind == "lstm" else layers.GRU)(4)(inp)
        out = head(k)
    elif kind == "mha":
        ishape = (6, c)
        inp = keras.Input(ishape)
        k = layers.MultiHeadAttention(num_heads=2, key_dim=4)(inp, inp)
        out = head(k)
    elif kind == "embedding":
        ishape, dtype = (6,), "int32"
        inp = keras.Input(ishape, dtype="int32")
        k = layers.Embedding(20, c)(inp)
        out = head(k)
    elif kind == "mnist_convnet":  # keras.io "Simple MNIST convnet"
        ishape = (28, 28, c)
        inp = keras.Input(ishape)
        t = layers.Conv2D(32, 3, activation="relu")(inp)
        t = layers.MaxPooling2D(2)(t)
        t = layers.Conv2D(64, 3, activation="relu")(t)
        k = layers.MaxPooling2D(2)(t)
        t = layers.Dropout(0.5)(layers.Flatten()(k))
        out = layers.Dense(1)(t)
    elif kind == "convnet32_bn":  # strided convs + BN, CIFAR-sized
        ishape = (32, 32, c)
        inp = keras.Input(ishape)
        t = inp
        for f in (16, 32, 64):
            t = layers.Conv2D(f, 3, strides=2, padding="same", use_bias=False)(
                t
            )
            t = layers.BatchNormalization()(t)
            t = layers.ReLU()(t)
        k = t
        out = layers.Dense(1)(layers.GlobalAveragePooling2D()(k))
    elif kind in ("resnet32_sync", "resnet32"):  # 2 stages of residual blocks
        sync = kind == "resnet32_sync"
        ishape = (32, 32, c)
        inp = keras.Input(ishape)
        t = layers.Conv2D(16, 3, padding="same", use_bias=False)(inp)
        t = layers.ReLU()(layers.BatchNormalization(synchronized=sync)(t))
        for f, st in ((16, 1), (32, 2)):
            a = layers.Conv2D(f, 3, strides=st, padding="same", use_bias=False)(
                t
            )
            a = layers.ReLU()(layers.BatchNormalization(synchronized=sync)(a))
            a = layers.Conv2D(f, 3, padding="same", use_bias=False)(a)
            a = layers.BatchNormalization(synchronized=sync)(a)
            sc = t
            if st != 1 or f != t.shape[-1]:
                sc = layers.Conv2D(f, 1, strides=st, use_bias=False)(t)
                sc = layers.BatchNormalization(synchronized=sync)(sc)
            t = layers.ReLU()(layers.Add()([a, sc]))
        k = t
        out = layers.Dense(1)(layers.GlobalAveragePooling2D()(k))
    else:
        raise ValueError(f"unknown kind {kind}")
    return inp, k, out, (ishape, dtype)


def conv_kind(stride, kernel, padding, spatial, bn, stem):
    """The kind string of one conv-matrix case (`c2d-s2-k3-same-12-bn-stem`)."""
    return (f"c2d-s{stride}-k{kernel}-{padding}-{spatial}"
            f"{'-bn' if bn else ''}{'-stem' if stem else ''}")


def parse_conv_kind(kind):
    parts = kind.split("-")
    return dict(stride=int(parts[1][1:]), kernel=int(parts[2][1:]),
                padding=parts[3], spatial=int(parts[4]), bn="bn" in parts,
                stem="stem" in parts)


def build_conv(kind, c):
    """Input (spatial x spatial x 3) [-> stem Conv2D(8, 3) -> ReLU] -> the
    tested Conv2D(c, kernel, stride, padding) [-> BatchNormalization] ->
    ReLU -> global average pool -> Dense(1).  With the stem, the tested
    convolution's input needs a gradient too (Conv2DBackpropInput), as in a
    ResNet's inner layers."""
    import keras
    from keras import layers

    p = parse_conv_kind(kind)
    ishape = (p["spatial"], p["spatial"], 3)
    inp = keras.Input(ishape)
    t = inp
    if p["stem"]:
        t = layers.ReLU()(layers.Conv2D(8, 3, padding="same")(t))
    k = layers.Conv2D(c, p["kernel"], strides=p["stride"],
                      padding=p["padding"], use_bias=not p["bn"])(t)
    if p["bn"]:
        k = layers.BatchNormalization()(k)
    t = layers.GlobalAveragePooling2D()(layers.ReLU()(k))
    return inp, k, layers.Dense(1)(t), (ishape, "float32")


def resnet12(c, sync):
    """Issue 37's model: a small ResNet, strided 3x3 convolutions, 12x12."""
    import keras
    from keras import layers

    inp = keras.Input((12, 12, c))
    t = layers.Conv2D(8, 3, padding="same", use_bias=False)(inp)
    t = layers.ReLU()(layers.BatchNormalization(synchronized=sync)(t))
    for f, st in ((8, 1), (16, 2), (32, 2)):
        a = layers.Conv2D(f, 3, strides=st, padding="same", use_bias=False)(t)
        a = layers.ReLU()(layers.BatchNormalization(synchronized=sync)(a))
        a = layers.Conv2D(f, 3, padding="same", use_bias=False)(a)
        a = layers.BatchNormalization(synchronized=sync)(a)
        sc = t
        if st != 1 or f != t.shape[-1]:
            sc = layers.Conv2D(f, 1, strides=st, use_bias=False)(t)
            sc = layers.BatchNormalization(synchronized=sync)(sc)
        t = layers.ReLU()(layers.Add()([a, sc]))
    out = layers.Dense(1)(layers.GlobalAveragePooling2D()(t))
    return inp, out


SKIP = (
    "Graph execution error",
    "Detected at node",
    "File ",
    "in user code",
    "Exception encountered when calling",
    "raise ",
    "Arguments received",
    "\u2022",
)


def first_line(e):
    """Exception type + its first informative line (TF/Keras wrap the real one)."""
    import re

    lines = [
        re.sub(r"\x1b\[[0-9;]*m", "", l).strip() for l in str(e).splitlines()
    ]
    lines = [
        l
        for l in lines
        if l and not l.startswith(SKIP) and not l.endswith("**")
    ]
    good = lines
    for keys in (
        ("!=", "must", "Incompatible", "corrupt"),
        ("shape", "Shape", "nvalid"),
        ("rror", "not "),
    ):
        hits = [l for l in lines if any(k in l for k in keys)]
        if hits:
            good = hits
            break
    return f"{type(e).__name__}: {good[0][:300] if good else ''}"


def child(kind, rows, c, stages):
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    inp, k, out, (ishape, dtype) = build(kind, c)
    model = keras.Model(inp, out)
    probe = keras.Model(inp, [k, out])
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    if dtype == "int32":
        x = rng.integers(0, 20, (rows,) + ishape).astype("int32")
    else:
        x = rng.standard_normal((rows,) + ishape).astype("float32")
    y = rng.standard_normal((rows, 1)).astype("float32")
    want_k = (rows,) + tuple(k.shape[1:])
    want_out = (rows, 1)

    def emit(stage, status, **kw):
        print(json.dumps(dict(stage=stage, status=status, **kw)), flush=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            kk, oo = probe(x, training=True)
            loss = tf.reduce_sum(tf.square(oo - y))
        grads = tape.gradient(loss, model.trainable_variables)
        return kk, oo, grads

    @tf.function
    def forward(x):
        return probe(x, training=True)

    def check(kk, oo):
        bad = []
        if tuple(kk.shape) != want_k:
            bad.append(f"layer out {tuple(kk.shape)} != {want_k}")
        if tuple(oo.shape) != want_out:
            bad.append(f"model out {tuple(oo.shape)} != {want_out}")
        return bad

    for stage in stages:
        print(json.dumps(dict(stage=stage, status="started")), flush=True)
        try:
            if stage == "tob":
                for _ in range(3):
                    loss = model.train_on_batch(x, y)
                emit("tob", "ok", loss=float(np.asarray(loss)))
            elif (
                stage == "mix"
            ):  # batch size changing between steps, as in fit()
                if dtype == "int32":
                    xb = rng.integers(0, 20, (8,) + ishape).astype("int32")
                else:
                    xb = rng.standard_normal((8,) + ishape).astype("float32")
                yb = rng.standard_normal((8, 1)).astype("float32")
                for _ in range(3):
                    model.train_on_batch(xb, yb)
                    model.train_on_batch(x, y)
                xf, yf = (
                    np.concatenate([xb, xb, x]),
                    np.concatenate([yb, yb, y]),
                )
                h = model.fit(
                    xf, yf, batch_size=8, epochs=2, shuffle=False, verbose=0
                )
                emit("mix", "ok", loss=float(h.history["loss"][-1]))
            elif stage == "fwd":
                bad = check(*forward(tf.constant(x)))
                emit("fwd", "wrong" if bad else "ok", detail="; ".join(bad))
            elif stage == "fn":
                kk, oo, grads = step(tf.constant(x), tf.constant(y))
                bad = check(kk, oo)
                for v, g in zip(model.trainable_variables, grads):
                    if g is not None and tuple(g.shape) != tuple(v.shape):
                        bad.append(
                            f"grad {v.path} {tuple(g.shape)} != {tuple(v.shape)}"
                        )
                    elif g is not None and not np.all(
                        np.isfinite(tf.convert_to_tensor(g))
                    ):
                        bad.append(f"grad {v.path} not finite")
                emit("fn", "wrong" if bad else "ok", detail="; ".join(bad))
        except Exception as e:  # noqa: BLE001 -- we report every kind of failure
            emit(stage, "error", detail=first_line(e))


# --------------------------------------------------------------------------
# driver side
# --------------------------------------------------------------------------
MIX = False  # --mix: add the "mix" stage for rows > 0


def stages_for(rows):
    return (
        ["fwd,fn", "tob"]
        if rows == 0
        else ["tob,fwd,fn" + (",mix" if MIX else "")]
    )


def child_env(onednn_off):
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        LIBC_FATAL_STDERR_="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH="",
    )
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    if onednn_off:
        env["TF_ENABLE_ONEDNN_OPTS"] = "0"
    return env


def spawn(args, onednn_off, timeout):
    cmd = [PYTHON, os.path.abspath(__file__)] + args
    try:
        p = subprocess.run(
            cmd,
            env=child_env(onednn_off),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd="/tmp",
        )
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        out, err = e.stdout or "", e.stderr or ""
        out = out.decode() if isinstance(out, bytes) else out
        err = err.decode() if isinstance(err, bytes) else err
        return "timeout", out, err


def make_record(rec, rc, lines, err):
    """Fill outcome/detail of `rec` from the child's JSON stage lines and exit."""
    results, last_started = {}, None
    for d in lines:
        if d["status"] == "started":
            last_started = d["stage"]
        else:
            results[d["stage"]] = d
    if rc == "timeout":
        rec["outcome"] = "timeout"
        rec["detail"] = f"timeout in stage {last_started}"
    elif isinstance(rc, int) and rc < 0:
        rec["outcome"] = f"signal {-rc} ({signal.Signals(-rc).name})"
        why = [
            l.strip()
            for l in err.splitlines()
            if any(
                k in l
                for k in (
                    "Check failed",
                    "corrupted",
                    "malloc",
                    "free()",
                    "F0000",
                    "Fatal",
                    "terminate",
                    "what()",
                    "double",
                    "Segmentation",
                    "Aborted",
                    "*** ",
                )
            )
        ]
        tail = [
            l for l in err.splitlines() if l.strip() and "cuda" not in l.lower()
        ]
        rec["detail"] = (
            f"in stage {last_started}; stderr: "
            + " | ".join(why[:3] or tail[-3:])[:400]
        )
    elif rc != 0:
        tail = [l for l in err.splitlines() if l.strip()]
        rec["outcome"] = f"exit {rc}"
        rec["detail"] = " | ".join(tail[-3:])[:400]
    else:
        bad = {st: r for st, r in results.items() if r["status"] != "ok"}
        rec["outcome"] = (
            "ok"
            if not bad
            else ",".join(f"{st}:{r['status']}" for st, r in bad.items())
        )
        rec["detail"] = " ; ".join(
            f"{st}: {r.get('detail')}" for st, r in bad.items()
        )
    rec["stage_results"] = {st: r["status"] for st, r in results.items()}
    return rec


# The conv matrix (issue 37 item 5).  The 2 shared cores give it ~12 minutes,
# so it is sampled: the "core" grid (every stride/kernel/padding, 8 spatial
# sizes, rows 1..8, the stem on: the tested conv's input needs a gradient,
# as in a ResNet) first, then BatchNorm and no-stem variants on the strided
# cases only, where the core grid fails.
CONV_SPATIAL = (4, 5, 6, 7, 8, 11, 12, 16)
CONV_ROWS = tuple(range(1, 9))
CONV_CHANNELS = 16
EDGE_ROWS = (9, 10, 11, 12, 13, 15, 16, 17, 31, 32, 59)


def conv_cases(part):
    if part == "core":
        combos = [(s, k, p, sp, False, True) for s in (1, 2) for k in (1, 3)
                  for p in ("same", "valid") for sp in CONV_SPATIAL]
    elif part == "edge":  # the failing kind: more sizes, larger batches
        combos = [(2, 1, p, sp, False, True) for p in ("same", "valid")
                  for sp in (10, 14, 24, 32)] + [
                      (2, 1, "same", sp, False, True) for sp in (12, 16)]
        return [(conv_kind(*combo), rows, CONV_CHANNELS, "tob")
                for combo in combos for rows in EDGE_ROWS]
    elif part == "variants":  # BatchNorm after it; no stem before it
        combos = [(2, 1, p, sp, bn, stem) for p in ("same", "valid")
                  for sp in (12, 16)
                  for bn, stem in ((True, True), (False, False))]
    elif part == "resnet":
        return [(kind, rows, 3, "tob") for kind in ("resnet12_sync",
                                                    "resnet12")
                for rows in CONV_ROWS]
    else:
        raise ValueError(f"unknown part {part}")
    return [(conv_kind(*combo), rows, CONV_CHANNELS, "tob")
            for combo in combos for rows in CONV_ROWS]


def json_lines(out):
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


def run_case(kind, rows, c, stages, onednn_off=False):
    """One case in its own child process (the reference measurement)."""
    t0 = time.time()
    rc, out, err = spawn(
        ["case", kind, str(rows), str(c), stages], onednn_off, TIMEOUT
    )
    rec = dict(
        kind=kind,
        rows=rows,
        channels=c,
        stages=stages,
        onednn=not onednn_off,
        mode="single",
        seconds=round(time.time() - t0, 1),
    )
    return [make_record(rec, rc, json_lines(out), err)]


def run_batch(cases, onednn_off=False):
    """Screening: several cases in one child, restarted after the case that kills it.

    Every non-ok case found this way is re-run in its own child (`rerun-failures`),
    so a heap corruption detected one case late cannot be misattributed."""
    recs, todo = [], list(cases)
    while todo:
        t0 = time.time()
        rc, out, err = spawn(
            ["batch", json.dumps(todo)], onednn_off, 30 + TIMEOUT * len(todo)
        )
        per_case, cur = {}, None
        for d in json_lines(out):
            if d.get("status") == "case_done":
                pass
            elif "case" in d:
                cur = d["case"]
                per_case[cur] = []
            else:
                per_case[cur].append(d)
        done = {
            d["case"] for d in json_lines(out) if d.get("status") == "case_done"
        }
        n_done = 0
        for i, (kind, rows, c, stages) in enumerate(todo):
            if i not in per_case:
                break
            rec = dict(
                kind=kind,
                rows=rows,
                channels=c,
                stages=stages,
                onednn=not onednn_off,
                mode="batch",
                seconds=round(time.time() - t0, 1),
            )
            recs.append(
                make_record(rec, 0 if i in done else rc, per_case[i], err)
            )
            n_done = i + 1
            if i not in done:
                break
        if (
            n_done == 0
        ):  # died before the first case began (e.g. import): record it
            kind, rows, c, stages = todo[0]
            rec = dict(
                kind=kind,
                rows=rows,
                channels=c,
                stages=stages,
                onednn=not onednn_off,
                mode="batch",
                seconds=0,
            )
            recs.append(make_record(rec, rc if rc != 0 else -6, [], err))
            n_done = 1
        todo = todo[n_done:]
    return recs


def matrix(kinds, rows_list, channels):
    for kind in kinds:
        keep = (
            channels
            if kind in FULL_CHANNEL_KINDS or kind in EXAMPLE_KINDS
            else NON_IMAGE_CHANNELS
            if kind in NON_IMAGE
            else SMALL_CHANNELS
        )
        chans = [c for c in channels if c in keep]
        for c in chans:
            for rows in rows_list:
                for st in stages_for(rows):
                    yield kind, rows, c, st


def drive(cases, out_path, repeat=1, onednn_off=False, batch=False,
          chunk=None):
    """Run cases (2 children at a time) and append records to `out_path`.

    `chunk`: with `batch`, `chunk` cases per child instead of one child per
    (kind, channels)."""
    cases = [c for c in cases for _ in range(repeat)]
    if batch and chunk:
        jobs = [(run_batch, cases[i:i + chunk])
                for i in range(0, len(cases), chunk)]
    elif batch:  # one child per (kind, channels) group
        groups = {}
        for c in cases:
            groups.setdefault((c[0], c[2]), []).append(c)
        jobs = [(run_batch, g) for g in groups.values()]
    else:
        jobs = [(run_case, c) for c in cases]
    done = 0
    with (
        open(out_path, "a") as f,
        concurrent.futures.ThreadPoolExecutor(PARALLEL) as ex,
    ):
        futs = [
            ex.submit(fn, *((arg,) if fn is run_batch else arg), onednn_off)
            for fn, arg in jobs
        ]
        for fu in concurrent.futures.as_completed(futs):
            for rec in fu.result():
                f.write(json.dumps(rec) + "\n")
                f.flush()
                done += 1
                if rec["outcome"] != "ok":
                    print(
                        f"[{done}/{len(cases)}] {rec['kind']} rows={rec['rows']} "
                        f"c={rec['channels']} {rec['stages']} onednn={rec['onednn']} "
                        f"{rec['mode']}: {rec['outcome']} {rec['detail'][:200]}",
                        flush=True,
                    )
                elif done % 20 == 0:
                    print(f"[{done}/{len(cases)}] ...", flush=True)


def load(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def short(rec):
    o = rec["outcome"]
    if o == "ok":
        return "ok"
    if o.startswith("signal"):
        return o.split("(")[1].rstrip(")")
    if o == "timeout":
        return "timeout"
    codes = []
    for part in rec.get("detail", "").split(" ; "):
        stage, _, d = part.partition(": ")
        code = (
            "shape"
            if d.startswith(("layer out", "model out", "grad"))
            else (d.split(":")[0].replace("Error", "") or "?")
        )
        codes.append(f"{stage}:{code}")
    return " ".join(codes)


def report(main_path, rerun_path, md_path):
    recs = load(main_path)
    reruns = load(rerun_path)
    kinds = [
        k for k in KINDS + EXAMPLE_KINDS if any(r["kind"] == k for r in recs)
    ]
    lines = [
        "# Shard shapes vs TF 2.21 oneDNN CPU kernels (one device, plain Keras)",
        "",
        "Generated by `shard_shapes.py report`. Cell = outcome of the child for",
        "(kind, channels, rows). For rows>0: `train_on_batch` x3, then tf.function forward",
        "(`fwd`), then forward+gradient (`fn`), shape-checked. rows=0: children `fwd,fn` / `tob`.",
        "`ok`; `ABRT`/`SEGV` = killed by signal; `Aborted`, `InvalidArgument`, ... =",
        "Python exception; `shape` = wrong output/gradient shape; `timeout` (60 s).",
        "",
    ]
    rows_list = sorted({r["rows"] for r in recs})
    hdr = (
        "| kind | ch | "
        + " | ".join(
            ("0 fwd,fn | 0 tob" if n == 0 else str(n)) for n in rows_list
        )
        + " |"
    )
    ncol = len(rows_list) + (1 if 0 in rows_list else 0)
    lines += [hdr, "|" + "---|" * (2 + ncol)]
    fails = []
    for kind in kinds:
        for c in sorted({r["channels"] for r in recs if r["kind"] == kind}):
            cells = []
            for n in rows_list:
                sts = stages_for(n)
                if n > 0:
                    sts = [
                        sorted(
                            {
                                r["stages"]
                                for r in recs
                                if (r["kind"], r["channels"], r["rows"])
                                == (kind, c, n)
                            }
                            or {"-"}
                        )[-1]
                    ]
                for st in sts:
                    rs = [
                        r
                        for r in recs
                        if (r["kind"], r["channels"], r["rows"], r["stages"])
                        == (kind, c, n, st)
                    ]
                    if not rs:
                        cells.append("-")
                        continue
                    outs = sorted({short(r) for r in rs})
                    cells.append("/".join(outs))
                    fails += [r for r in rs if r["outcome"] != "ok"]
            lines.append(f"| {kind} | {c} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Failing cases (first run)",
        "",
        "| kind | rows | ch | stages | outcome | detail |",
        "|---|---|---|---|---|---|",
    ]
    for r in fails:
        d = r.get("detail", "").replace("|", "/")[:250]
        lines.append(
            f"| {r['kind']} | {r['rows']} | {r['channels']} | {r['stages']} | "
            f"{r['outcome']} | {d} |"
        )
    if reruns:
        lines += [
            "",
            "## Reruns of failing cases (oneDNN on vs TF_ENABLE_ONEDNN_OPTS=0)",
            "",
            "| kind | rows | ch | stages | oneDNN on | oneDNN off |",
            "|---|---|---|---|---|---|",
        ]
        keys = sorted(
            {
                (r["kind"], r["rows"], r["channels"], r["stages"])
                for r in reruns
            },
            key=lambda k: (
                (KINDS + EXAMPLE_KINDS).index(k[0]),
                k[2],
                k[1],
                k[3],
            ),
        )
        for key_ in keys:
            rs = [r for r in reruns if key(r) == key_]
            on = [short(r) for r in rs if r["onednn"]] or [
                short(r) + " (main run)"
                for r in recs
                if key(r) == key_ and r["onednn"]
            ]
            off = [short(r) for r in rs if not r["onednn"]]
            lines.append(
                f"| {key_[0]} | {key_[1]} | {key_[2]} | {key_[3]} | "
                f"{', '.join(on)} | {', '.join(off)} |"
            )
    with open(md_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def conv_report():
    """conv_matrix.md and conv_matrix.json from conv_matrix.jsonl."""
    recs = load(os.path.join(HERE, "conv_matrix.jsonl"))
    cells = {}
    for r in recs:
        cells.setdefault((r["kind"], r["onednn"]), {}).setdefault(
            r["rows"], []).append(short(r).replace("tob:", ""))
    kinds = sorted({k for k, _ in cells}, key=lambda k: (
        k.startswith("resnet"), k.split("-")[1:3], k))
    rows_list = sorted({r["rows"] for r in recs})
    runs_on = [r for r in recs if r["onednn"]]
    bad_on = [r for r in runs_on if r["outcome"] != "ok"]
    runs_off = [r for r in recs if not r["onednn"]]
    bad_off = [r for r in runs_off if r["outcome"] != "ok"]
    even_bad = [r for r in bad_on if r["rows"] % 2 == 0]
    lines = [
        "# Conv2D shapes vs TF 2.21 oneDNN CPU kernels (issue 37)",
        "",
        "Generated by `shard_shapes.py conv-report` from `conv_matrix.jsonl`."
        " Plain Keras,",
        "one CPU device, no keras-mirror: each case builds input (s x s x 3)"
        " [-> `stem` Conv2D(8, 3) -> ReLU]",
        "-> the tested Conv2D(16, k, stride, padding) [-> `bn`"
        " BatchNormalization] -> ReLU -> GAP -> Dense(1)",
        "and runs `train_on_batch` 3 times on `rows` rows. `resnet12`:"
        " issue 37's ResNet (strided 3x3 convs,",
        "strided 1x1 shortcuts, 12x12, plain or synchronized BN). Children"
        " run up to 48 cases, restarted after",
        "a crash (`nice -n 10`, 2 at a time, 2 shared cores). Cell: every"
        " run's outcome, `ok`, `SIGABRT`,",
        "`SIGSEGV`, `Aborted` (`AbortedError` in `Conv2DBackpropFilter`,"
        " \"could not create a primitive",
        "descriptor for the reorder primitive\"), `-` = not run. A crash"
        " is put on the case its child was running; the pattern (odd"
        " batches only) and the one-case reproduction in `docs/onednn.md`"
        " agree.",
        "",
        f"oneDNN on: {len(bad_on)} of {len(runs_on)} runs failed, "
        f"{len(even_bad)} of them on an even batch. "
        f"TF_ENABLE_ONEDNN_OPTS=0 (every failing case and the ResNets "
        f"again): {len(bad_off)} of {len(runs_off)} failed.",
        "",
    ]
    for onednn in (True, False):
        shown = [k for k in kinds if (k, onednn) in cells]
        if not shown:
            continue
        lines += [f"## oneDNN {'on (default)' if onednn else 'off'}", "",
                  "| case | " + " | ".join(map(str, rows_list)) + " |",
                  "|---|" + "---|" * len(rows_list)]
        for k in shown:
            row = cells[(k, onednn)]
            lines.append(f"| {k} | " + " | ".join(
                "/".join(sorted(set(row[n]))) if n in row else "-"
                for n in rows_list) + " |")
        lines.append("")
    with open(os.path.join(HERE, "conv_matrix.md"), "w") as f:
        f.write("\n".join(lines))
    summary = dict(
        runs_onednn_on=len(runs_on), failed_onednn_on=len(bad_on),
        failed_even_rows_onednn_on=len(even_bad),
        runs_onednn_off=len(runs_off), failed_onednn_off=len(bad_off),
        failing_cases=sorted({(r["kind"], r["rows"]) for r in bad_on}),
        outcomes_onednn_on=sorted({short(r) for r in bad_on}))
    with open(os.path.join(HERE, "conv_matrix.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("\n".join(lines))


def key(r):
    return (r["kind"], r["rows"], r["channels"], r["stages"])


def is_crash(r):
    return r["outcome"].startswith(
        ("signal", "timeout", "exit")
    ) or "Aborted" in r.get("detail", "")


def parse_list(s, cast=str):
    return [cast(v) for v in s.split(",")] if s else None


def main(argv):
    if argv[0] == "case":
        kind, rows, c, stages = (
            argv[1],
            int(argv[2]),
            int(argv[3]),
            argv[4].split(","),
        )
        child(kind, rows, c, stages)
        return
    if argv[0] == "batch":
        import keras

        for i, (kind, rows, c, stages) in enumerate(json.loads(argv[1])):
            print(json.dumps(dict(case=i)), flush=True)
            child(kind, rows, c, stages.split(","))
            print(json.dumps(dict(case=i, status="case_done")), flush=True)
            keras.backend.clear_session()
        return
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["run", "rerun-failures", "report",
                                    "conv-matrix", "conv-off",
                                    "conv-report"])
    ap.add_argument("--part", default="core",
                    help="conv-matrix: core, variants or resnet")
    ap.add_argument("--kinds")
    ap.add_argument("--rows")
    ap.add_argument("--channels")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--onednn-off", action="store_true")
    ap.add_argument(
        "--batch",
        action="store_true",
        help="screen: one child per (kind, channels), restarted after a crash",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "results.jsonl"))
    ap.add_argument("--reruns", default=os.path.join(HERE, "reruns.jsonl"))
    ap.add_argument("--md", default=os.path.join(HERE, "results.md"))
    ap.add_argument(
        "--mix", action="store_true", help="add the mixed-batch-size stage"
    )
    a = ap.parse_args(argv)
    global MIX
    MIX = a.mix
    if a.cmd == "run":
        cases = list(
            matrix(
                parse_list(a.kinds) or KINDS,
                parse_list(a.rows, int) or ROWS,
                parse_list(a.channels, int) or CHANNELS,
            )
        )
        have = {
            (r["kind"], r["rows"], r["channels"], r["stages"], r["onednn"])
            for r in load(a.out)
        }
        cases = [
            c for c in cases if c + (not a.onednn_off,) not in have
        ]  # resume
        drive(cases, a.out, a.repeat, a.onednn_off, a.batch)
    elif a.cmd == "conv-matrix":
        out = os.path.join(HERE, "conv_matrix.jsonl")
        drive(conv_cases(a.part), out, a.repeat, a.onednn_off, batch=True,
              chunk=48)
    elif a.cmd == "conv-off":  # every non-ok case again, oneDNN off
        out = os.path.join(HERE, "conv_matrix.jsonl")
        recs = load(out)
        bad = sorted({key(r) for r in recs
                      if r["outcome"] != "ok" and r["onednn"]})
        bad += conv_cases("resnet")
        drive(bad, out, a.repeat, onednn_off=True, batch=True, chunk=48)
    elif a.cmd == "conv-report":
        conv_report()
    elif a.cmd == "rerun-failures":
        # crashes (signal, timeout, AbortedError) and any failure with rows > 0:
        # 3 single children with oneDNN on, 3 with it off.  0-row exceptions are
        # deterministic graph errors: one batch child per kind with oneDNN off.
        fails = [r for r in load(a.out) if r["outcome"] != "ok"]
        crash = sorted({key(r) for r in fails if r["rows"] > 0 or is_crash(r)})
        zero = sorted({key(r) for r in fails} - set(crash))
        drive(crash, a.reruns, repeat=3)
        drive(crash, a.reruns, repeat=3, onednn_off=True)
        drive(zero, a.reruns, onednn_off=True, batch=True)
    else:
        report(a.out, a.reruns, a.md)


if __name__ == "__main__":
    main(sys.argv[1:])
