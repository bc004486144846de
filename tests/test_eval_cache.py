"""workers.evaluation.evaluate's stored results: read back only when they verify (otherwise recomputed
with a one-line warning), and no pickle cache under cache_dir is handed to lm-eval."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from test_evaluate import model, run, tiny_dir, tok  # noqa: F401  (the module-scoped fixtures)

N = 8


def stored(cache: Path, task: str, limit: int = N) -> Path:
    """The stored result of `task` for a run with `limit` (the one file whose row has that n)."""
    found = [
        p
        for p in (cache / "runs").rglob(f"{task}-*.json")
        if f'"n": {limit},' in p.read_text(errors="replace")
    ]
    assert len(found) == 1, found
    return found[0]


def edit_acc(doc: dict, value: float) -> None:
    """An accuracy edited where it is read: the row and lm-eval's section (the per-item scores kept)."""
    doc["row"]["acc"] = value
    doc["sections"]["results"]["tiny_mc"]["acc,none"] = value


def edited(cache: Path) -> None:
    p = stored(cache, "tiny_mc")
    doc = json.loads(p.read_text())
    edit_acc(doc, 0.875)
    p.write_text(json.dumps(doc))


def resealed(cache: Path) -> None:
    """The same edit, with the stored content hash recomputed (a tool that rewrites the file whole): only
    the per-item scores, which still say otherwise, give it away."""
    from workers.evaluation.evaluate import _seal

    p = stored(cache, "tiny_mc")
    doc = json.loads(p.read_text())
    edit_acc(doc, 0.875)
    p.write_text(json.dumps(_seal({k: doc[k] for k in ("key", "row", "sections")})))


def truncated(cache: Path) -> None:
    p = stored(cache, "tiny_mc")
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def stale(cache: Path) -> None:
    """Another run's result (a file copied or renamed) under this run's name."""
    shutil.copyfile(stored(cache, "tiny_mc", limit=4), stored(cache, "tiny_mc"))


@pytest.mark.parametrize("damage", [edited, resealed, truncated, stale], ids=lambda f: f.__name__)
def test_a_stored_result_that_does_not_verify_is_recomputed(model, tok, tiny_dir, tmp_path, capsys, damage):  # noqa: F811
    cache = tmp_path / "cache"
    run(model, tok, "tiny", cache, tiny_dir=tiny_dir, limit=4)
    first = run(model, tok, "tiny", cache, tiny_dir=tiny_dir, limit=N)
    mc = first["tasks"][0]
    assert mc["task"] == "tiny_mc" and mc["acc"] != 0.875 and mc["n"] == N
    again = run(model, tok, "tiny", cache, tiny_dir=tiny_dir, limit=N)
    assert again["runs"][0]["reused"] == ["tiny_mc", "tiny_ppl"], "an intact stored result is read back"
    assert again["tasks"] == first["tasks"]
    capsys.readouterr()

    damage(cache)
    res = run(model, tok, "tiny", cache, tiny_dir=tiny_dir, limit=N)
    warned = [line for line in capsys.readouterr().err.splitlines() if "did not verify" in line]
    assert res["tasks"] == first["tasks"] and res["average"] == first["average"]
    assert res["runs"][0]["reused"] == ["tiny_ppl"], "the damaged result was recomputed"
    assert len(warned) == 1 and "tiny_mc" in warned[0] and warned[0].endswith("recomputed")
    res = run(model, tok, "tiny", cache, tiny_dir=tiny_dir, limit=N)
    assert res["runs"][0]["reused"] == ["tiny_mc", "tiny_ppl"] and res["tasks"] == first["tasks"], (
        "the recomputed result replaced the damaged one"
    )


class Planted:
    """A pickled value that makes a directory when it is unpickled, and unpickles as a valid response."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"__import__('os').makedirs({str(self.marker)!r}, exist_ok=True) or (0.0, False)",))


def test_no_pickle_from_the_cache_dir_is_loaded(model, tok, tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    """lm-eval's response cache is a pickle store (SqliteDict): one planted where evaluate.py pointed it
    (cache_dir/responses/<model key>/<backend>/lm_rank0.db), under the very requests a run makes, must
    not be read; the run's numbers are the model's own."""
    from lm_eval.api.model import hash_args
    from lm_eval.models.huggingface import HFLM
    from sqlitedict import SqliteDict

    requests = []
    real = HFLM.loglikelihood

    def spy(self, reqs, *a, **k):
        requests.extend(r.args for r in reqs)
        return real(self, reqs, *a, **k)

    monkeypatch.setattr(HFLM, "loglikelihood", spy)
    cache = tmp_path / "cache"
    first = run(model, tok, "tiny", cache, key="m", tiny_dir=tiny_dir, limit=2)
    assert requests
    shutil.rmtree(cache / "runs")  # no stored result: the next call evaluates again
    marker = tmp_path / "planted-code-ran"
    db = cache / "responses" / hashlib.sha256(b"m").hexdigest()[:24] / "hf" / "lm_rank0.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    with SqliteDict(str(db), autocommit=True) as d:
        for args in requests:
            d[hash_args("loglikelihood", args)] = Planted(marker)
    res = run(model, tok, "tiny", cache, key="m", tiny_dir=tiny_dir, limit=2)
    assert not marker.exists(), "a pickle under cache_dir was unpickled"
    assert res["tasks"] == first["tasks"]
