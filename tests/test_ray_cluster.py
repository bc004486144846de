"""A real two-node Ray cluster on this machine (tests/ray_cluster.py): a head with the custom resource
`head_only`, a worker node with `gpu_like`. `moesweep launch --address` runs a sweep on it whose
calibration declares `head_only` and whose conversions declare `gpu_like`; every job's record says on
which node it ran (jobs.versions_json) and that node has what the job declared. Then two launches of one
sweep, their drivers on different nodes, share one PostgreSQL database: no job runs twice."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from db.store import Store
from orchestrator.spec import load_spec
from tests.ray_cluster import LocalCluster, launch, marked
from tests.test_orchestrator import fake_sweep

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the clean-up reads /proc")]

SWEEP = """name: cluster
description: fake stages on a two-node Ray cluster
teacher: {source: hf, model: fake/teacher, num_experts: 8, top_k: 2}
calibration: {n_samples: 4, seq_len: 8}
grid: {scoring: [SF, CP], grouping: [RR], dp_scaling: [uniform], K: [2, 4]}
execution:
  retries: 0
  resources: {calibrate: {cpus: 1, custom: {head_only: 1}}, convert: {cpus: 1, custom: {gpu_like: 1}}}
"""


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster({"head_only": 1}, {"gpu_like": 1})
    try:
        yield c.start()
    finally:
        c.stop()
    assert not marked(c.token)  # nothing of the cluster is left


def _sweep(tmp_path: Path) -> Path:
    return fake_sweep(tmp_path, SWEEP)


def _runs(home: Path) -> list[dict]:
    return [json.loads(ln) for ln in (home / "runs.jsonl").read_text().splitlines()]


def _finish(proc, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def test_each_job_runs_on_a_node_that_has_what_it_declared(cluster, tmp_path):
    sweep, home = _sweep(tmp_path), tmp_path / "home"
    home.mkdir()
    db = f"sqlite:///{tmp_path}/c.db"
    proc = launch(cluster, sweep, db, home)
    out = _finish(proc)
    assert proc.returncode == 0, out + cluster.logs()
    head, worker = cluster.node_with("head_only"), cluster.node_with("gpu_like")
    assert f"driver-node {head}" in out  # `--address` joined the cluster (a local Ray has one node)

    spec = load_spec(str(sweep))[0]
    rows = Store(db).query("SELECT stage, status, versions_json FROM jobs")[1]
    assert rows and {s for _, s, _ in rows} == {"succeeded"}
    ran_on: dict[str, set[str]] = {}
    for stage, _, versions in rows:
        where = json.loads(versions)
        node = where["ray_node"]
        assert node in cluster.nodes, (stage, where)
        res = spec.resources(stage)
        declared = {"CPU": res.cpus, "GPU": res.gpus, **res.custom}
        has = cluster.nodes[node]
        assert all(has.get(k, 0) >= v for k, v in declared.items() if v), (stage, declared, has)
        assert all(where["ray_resources"].get(k, 0) >= v for k, v in declared.items() if v), (stage, where)
        ran_on.setdefault(stage, set()).add(node)
    assert ran_on["calibrate"] == {head} and ran_on["convert"] == {worker}
    assert set().union(*ran_on.values()) == {head, worker}
    assert Counter(r["key"] for r in _runs(home)).most_common(1)[0][1] == 1  # each job ran once


def test_two_launches_with_drivers_on_different_nodes_share_one_postgresql_and_run_no_job_twice(
        cluster, tmp_path, pg_database):
    sweep, home = _sweep(tmp_path), tmp_path / "home"
    home.mkdir()
    db = pg_database("two_drivers")
    Store(db).engine.dispose()  # migrated once, before the two launches race
    a = launch(cluster, sweep, db, home)  # its driver on the head
    b = launch(cluster, sweep, db, home, temp_dir=cluster.worker_temp)  # its driver on the worker node
    out_a, out_b = _finish(a), _finish(b)
    assert a.returncode == 0 and b.returncode == 0, out_a + out_b + cluster.logs()
    assert f"driver-node {cluster.node_with('head_only')}" in out_a
    assert f"driver-node {cluster.node_with('gpu_like')}" in out_b

    store = Store(db)
    rows = store.query("SELECT key, status, attempts, owner FROM jobs")[1]
    assert rows and all(s == "succeeded" and n == 1 for _, s, n, _ in rows), rows
    runs = Counter(r["key"] for r in _runs(home))
    assert set(runs) == {k for k, *_ in rows} and max(runs.values()) == 1  # every job ran, none twice
    assert store.query("SELECT COUNT(*) FROM results WHERE sweep = 'cluster' AND ppl_pre IS NOT NULL")[1] == [(4,)]
    store.engine.dispose()


def test_a_custom_resource_is_not_a_builtin_one(tmp_path):
    from orchestrator.spec import SpecError

    text = SWEEP.replace("custom: {gpu_like: 1}", "custom: {GPU: 1}")
    with pytest.raises(SpecError) as e:
        load_spec(str(fake_sweep(tmp_path, text)))
    assert "custom resource 'GPU' is built in; use cpus / gpus" in str(e.value) and "\n" not in str(e.value)
