"""A Ray cluster given by address (--address, RAY_ADDRESS) that cannot be joined is one line before any job is
claimed: nothing listening there is found by a TCP probe at once (ray.init would retry for minutes), and a
listener that is not a Ray head fails ray.init, whose error becomes one line."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.execute import ClusterError, RayExecutor, unreachable


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_the_probe_tells_a_listener_from_nothing():
    port = closed_port()
    assert unreachable(f"127.0.0.1:{port}") == f"nothing answers at 127.0.0.1:{port} (Connection refused)"
    assert (
        unreachable(f"ray://127.0.0.1:{port}") == f"nothing answers at 127.0.0.1:{port} (Connection refused)"
    )
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert unreachable(f"127.0.0.1:{server.getsockname()[1]}") is None
    for address in ("auto", "local", "anyscale://x", "no-port-here"):  # forms Ray resolves itself
        assert unreachable(address) is None


def test_launch_with_nothing_at_the_address_is_one_line_and_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    port = closed_port()
    sweep = str(Path(__file__).parent / "sweeps" / "micro.yaml")
    for args, env, name in (
        (["--address", f"127.0.0.1:{port}"], {}, "--address"),
        ([], {"RAY_ADDRESS": f"127.0.0.1:{port}"}, "RAY_ADDRESS"),
    ):
        r = CliRunner().invoke(app, ["launch", sweep, "--db", f"sqlite:///{tmp_path}/r.db", *args], env=env)
        assert r.exit_code == 2, r.output
        assert r.output.strip() == (
            f"error: {name} 127.0.0.1:{port}: nothing answers at 127.0.0.1:{port} (Connection refused); start "
            "the cluster (`ray start --head`), or leave it out for a local Ray"
        )
    assert not (tmp_path / "r.db").exists() and not (tmp_path / "home").exists()


def test_a_listener_that_is_not_a_ray_head_is_one_line(monkeypatch):
    import ray

    def refuse(**kw):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.9:6379\nmore detail")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    ex = RayExecutor(address="10.0.0.9:6379")
    with pytest.raises(ClusterError) as e:
        ex.connect()
    assert str(e.value) == (
        "cannot join the Ray cluster at 10.0.0.9:6379: Failed to connect to Ray cluster at 10.0.0.9:6379"
    )
