"""`launch._quiet`: TensorFlow's start-up noise hidden, the rest kept."""

import os
import sys

from test_launch import _clean_session  # noqa: F401

from keras_mirror.launch import _quiet

NOISE = (
    b"WARNING: All log messages before absl::InitializeLog() is called are "
    b"written to STDERR\n"
    b"I0000 00:00:1.0 7909 port.cc:153] oneDNN custom operations are on. "
    b"You may see slightly different numerical results\n"
    b"I0000 00:00:1.0 7909 cudart_stub.cc:31] Could not find cuda drivers on "
    b"your machine, GPU will not be used.\n"
    b"E0000 00:00:1.0 7909 cuda_platform.cc:52] failed call to cuInit: "
    b"INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n"
)


def test_only_the_noise_is_hidden(capfd, monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    with _quiet.native_stderr():
        os.write(2, NOISE)
        os.write(2, b"W0000 something the user should see\n")
        print("a Python warning", file=sys.stderr)
    # (Under capfd, Python's writes bypass fd 2: compare without order.)
    assert sorted(capfd.readouterr().err.splitlines()) == [
        "W0000 something the user should see", "a Python warning"]


def test_level_zero_shows_everything(capfd, monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    with _quiet.native_stderr():
        os.write(2, NOISE)
    assert capfd.readouterr().err == NOISE.decode()
