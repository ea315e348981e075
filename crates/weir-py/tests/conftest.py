"""Fixtures: `weir sim` servers on 127.0.0.1, started and stopped by the tests.

The simulator is the `weir` binary's `sim` command: WEIR_BIN names it, else the debug build
in CARGO_TARGET_DIR (or the repository's target/), which `cargo test` has just built.
"""
import json
import os
import socket
import subprocess
import tempfile
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def weir_bin():
    if os.environ.get("WEIR_BIN"):
        return os.environ["WEIR_BIN"]
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    path = os.path.join(target, "debug", "weir")
    if not os.path.exists(path):
        pytest.fail(f"no weir binary at {path}: run `cargo build -p weir` or set WEIR_BIN")
    return path


class Sim:
    """A running `weir sim`: its base URL and its own counts."""

    def __init__(self, *args):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [weir_bin(), "sim", "--listen", f"127.0.0.1:{port}", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
        )
        # The simulator says where it listens once it does.
        if not self.proc.stdout.readline():
            self.proc.wait(timeout=10)
            self.log.seek(0)
            raise RuntimeError(f"weir sim {args} did not start: {self.log.read().decode()}")
        self.url = f"http://127.0.0.1:{port}"

    def stats(self):
        return json.load(urllib.request.urlopen(self.url + "/stats"))

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path, monkeypatch):
    """Each test in a directory of its own: engines keep their default cache in `.weir/` of the
    working directory, and one test's answers must not answer another's calls."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def sim_factory():
    started = []

    def start(*args):
        s = Sim(*args)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def sim(sim_factory):
    return sim_factory("--latency-ms", "5")
