"""No dead code in `keras_mirror`: nothing defined that nothing calls.

vulture reads the package alone (not the tests), so a helper that only a
test calls counts as dead too: the tests check what the package does,
not code kept alive for them. What vulture cannot see being used (names
Keras or Python call by protocol, public API that users call) is in
`ALLOWED`, each with its reason; an entry vulture no longer reports is
stale and fails the test too, so the list stays short and true.
"""

import vulture
from support import helpers

PACKAGE = helpers.ROOT / "keras_mirror"

# (module relative to keras_mirror/, name) -> why it is not dead.
ALLOWED = {
    ("__init__.py", "__getattr__"): "module protocol (PEP 562)",
    ("__init__.py", "__dir__"): "module protocol (PEP 562)",
    ("callbacks/_backup_fields.py", "__doc__"): "set for `help()`",
    ("callbacks/_replica_logs.py", "on_train_batch_end"): "Keras hook",
    ("callbacks/_replica_logs.py", "on_test_batch_end"): "Keras hook",
    ("callbacks/_replica_logs.py", "on_predict_batch_end"): "Keras hook",
    ("callbacks/_replica_logs.py", "on_test_end"): "Keras hook",
    ("callbacks/replica_history.py", "on_train_batch_end"): "Keras hook",
    ("callbacks/replica_tensorboard.py", "on_train_batch_end"):
        "Keras hook, set per `update_freq`",
    ("callbacks/step_backup.py", "on_train_batch_end"): "Keras hook",
    ("verify.py", "on_train_batch_end"): "Keras hook",
    ("mirrored_model.py", "get_config"): "Keras serialization protocol",
    ("replica_context.py", "all_reduce_mean"):
        "public API of ReplicaContext (docs/guide.md)",
    ("distribute/_virtual_shards.py", "auto_shard_policy"):
        "a tf.data option, set for TensorFlow to read",
    ("steps/_capacity.py", "predict_function"):
        "Keras's cached step function, reset for Keras to retrace",
    # The step's record of what it traced and decided (`StepState`), read
    # by the tests of those decisions; `summary()` is to show the plan.
    ("steps/_state.py", "one_trace_last"): "decision record",
    ("steps/_one_trace.py", "one_trace_last"): "decision record",
    ("steps/_state.py", "one_update_reason"): "decision record",
    ("steps/_one_update.py", "one_update_reason"): "decision record",
    ("steps/_state.py", "xla_last"): "decision record",
    ("steps/_xla.py", "xla_last"): "decision record",
}


def _reported():
    scan = vulture.Vulture()
    scan.scavenge([str(PACKAGE)])
    return {(str(item.filename.relative_to(PACKAGE)), item.name): item
            for item in scan.get_unused_code(min_confidence=60)}


def test_no_dead_code():
    reported = _reported()
    dead = sorted(f"{module}:{item.first_lineno}: {item.message}"
                  for (module, name), item in reported.items()
                  if (module, name) not in ALLOWED)
    assert not dead, "dead code (delete it, or allow it with its reason):\n" \
        + "\n".join(dead)


def test_the_allow_list_holds_only_what_vulture_still_reports():
    stale = sorted(set(ALLOWED) - set(_reported()))
    assert not stale, f"no longer reported, drop from ALLOWED: {stale}"


def test_vulture_finds_a_function_nothing_calls(tmp_path):
    (tmp_path / "m.py").write_text(
        "def used():\n    return 1\n\n\ndef unused():\n    return used()\n"
        "\n\nprint(used())\n")
    scan = vulture.Vulture()
    scan.scavenge([str(tmp_path)])
    assert [i.name for i in scan.get_unused_code(min_confidence=60)] == [
        "unused"]
