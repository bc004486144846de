"""A real two-node Ray cluster on this machine (tests/ray_cluster.py): a head with the custom resource
`head_only`, a worker node with `gpu_like`, one CPU each. Two `moesweep launch --address` of one sweep
whose calibration declares `head_only` and whose conversions declare `gpu_like`, their drivers on
different nodes, share one PostgreSQL database: no job runs twice, and every job's record says on which
node it ran (jobs.versions_json), a node that has what the job declared."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from db.store import Store
from orchestrator.spec import load_spec
from tests.ray_cluster import SWEEP, LocalCluster, launch, marked
from tests.test_orchestrator import fake_sweep

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the clean-up reads /proc"),
]


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


def _outputs(*procs, timeout: float = 240) -> list[str]:
    """Each launch's output once it ended; launches still running after `timeout` are killed."""
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_two_launches_on_a_cluster_run_each_job_once_on_a_node_that_has_what_it_declared(
    cluster, tmp_path, pg_database
):
    """Two `moesweep launch --address` of one sweep, the first driver on the head, the second on the worker
    node, one PostgreSQL database: every job ran once, on a node with the resources it declared."""
    sweep, home = _sweep(tmp_path), tmp_path / "home"
    home.mkdir()
    db = pg_database("two_drivers")
    Store(db).engine.dispose()  # migrated once, before the two launches race
    a = launch(cluster, sweep, db, home)
    b = launch(cluster, sweep, db, home, temp_dir=cluster.worker_temp)
    out_a, out_b = _outputs(a, b)
    assert a.returncode == 0 and b.returncode == 0, out_a + out_b + cluster.logs()
    head, worker = cluster.node_with("head_only"), cluster.node_with("gpu_like")
    assert f"driver-node {head}" in out_a and f"driver-node {worker}" in out_b  # both joined the one cluster

    store = Store(db)
    rows = store.query("SELECT key, stage, status, attempts, versions_json FROM jobs")[1]
    assert rows and all(status == "succeeded" and n == 1 for _, _, status, n, _ in rows), rows
    runs = Counter(r["key"] for r in _runs(home))
    assert set(runs) == {k for k, *_ in rows} and max(runs.values()) == 1  # every job ran, none twice
    assert store.query("SELECT COUNT(*) FROM results WHERE sweep = 'cluster' AND ppl_pre IS NOT NULL")[1] == [
        (4,)
    ]
    store.engine.dispose()

    spec = load_spec(str(sweep))[0]
    ran_on: dict[str, set[str]] = {}
    for _, stage, _, _, versions in rows:
        where = json.loads(versions)
        res = spec.resources(stage)
        declared = {"CPU": res.cpus, "GPU": res.gpus, **res.custom}
        has = cluster.nodes[where["ray_node"]]
        assert all(has.get(k, 0) >= v for k, v in declared.items() if v), (stage, declared, has)
        assert all(where["ray_resources"].get(k, 0) >= v for k, v in declared.items() if v), (stage, where)
        ran_on.setdefault(stage, set()).add(where["ray_node"])
    assert ran_on["calibrate"] == {head} and ran_on["convert"] == {worker}


def test_a_custom_resource_is_not_a_builtin_one(tmp_path):
    from orchestrator.spec import SpecError

    text = SWEEP.replace("custom: {gpu_like: 1}", "custom: {GPU: 1}")
    with pytest.raises(SpecError) as e:
        load_spec(str(fake_sweep(tmp_path, text)))
    assert "custom resource 'GPU' is built in; use cpus / gpus" in str(e.value) and "\n" not in str(e.value)
