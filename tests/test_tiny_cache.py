"""workers.tiny.teacher's model cache: an entry is copied only when it matches the manifest recorded when
it was built (otherwise it is rebuilt, with one line on stderr), and a rebuild that does not reproduce
the recorded content says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_tiny import SMALL

from workers.tiny.teacher import TinyTeacherSpec, train_tiny_teacher

QUICK = {**SMALL, "steps": 2, "warmup": 1, "eval_windows": 2}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_cache")


def flip_weights(entry: Path) -> None:
    """Bit rot in the cached weights: one byte of tensor data changed, the file still loads."""
    f = entry / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-7] ^= 0x40
    f.write_bytes(bytes(data))


def edit_record(entry: Path) -> None:
    """The cached record edited: a better teacher perplexity than was measured."""
    f = entry / "tiny_meta.json"
    meta = json.loads(f.read_text())
    meta["record"]["valid_ppl_teacher"] /= 2
    f.write_text(json.dumps(meta, indent=1))


def extra_file(entry: Path) -> None:
    (entry / "extra.json").write_text("{}")


def lines(err: str, what: str) -> list[str]:
    return [line for line in err.splitlines() if what in line]


@pytest.mark.parametrize("damage", [flip_weights, edit_record, extra_file], ids=lambda f: f.__name__)
def test_a_damaged_cached_teacher_is_rebuilt(cache, tmp_path, capsys, damage):
    spec = TinyTeacherSpec(**QUICK)
    first = train_tiny_teacher(spec, tmp_path / "a", cache_dir=cache)
    again = train_tiny_teacher(spec, tmp_path / "b", cache_dir=cache)
    assert again["cached"] is True, "an intact entry is copied"
    entry = Path(first["cache_dir"])
    capsys.readouterr()

    damage(entry)
    rebuilt = train_tiny_teacher(spec, tmp_path / "c", cache_dir=cache)
    err = capsys.readouterr().err
    assert rebuilt["cached"] is False, "the damaged entry was not copied"
    assert len(lines(err, "did not verify")) == 1 and lines(err, "did not verify")[0].endswith("rebuilt")
    assert lines(err, "did not reproduce") == [], "training on the CPU is deterministic"
    assert rebuilt["valid_ppl_teacher"] == first["valid_ppl_teacher"]
    for f in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "c" / f).read_bytes() == (tmp_path / "a" / f).read_bytes(), f
    assert not (tmp_path / "c" / "extra.json").exists()
    last = train_tiny_teacher(spec, tmp_path / "d", cache_dir=cache)
    assert last["cached"] is True and capsys.readouterr().err.count("did not verify") == 0


def test_a_rebuild_that_does_not_reproduce_the_recorded_teacher_is_reported(
    cache, tmp_path, capsys, monkeypatch
):
    spec = TinyTeacherSpec(**{**QUICK, "seed": 3})
    first = train_tiny_teacher(spec, tmp_path / "a", cache_dir=cache)
    shutil.rmtree(first["cache_dir"])  # the entry gone, what it held still recorded
    capsys.readouterr()
    same = train_tiny_teacher(spec, tmp_path / "b", cache_dir=cache)
    assert same["cached"] is False and capsys.readouterr().err.count("did not reproduce") == 0
    shutil.rmtree(first["cache_dir"])

    seed = torch.manual_seed
    monkeypatch.setattr(torch, "manual_seed", lambda s: seed(s + 1))  # as if training were not deterministic
    other = train_tiny_teacher(spec, tmp_path / "c", cache_dir=cache)
    err = capsys.readouterr().err
    assert other["cached"] is False and other["valid_ppl_teacher"] != first["valid_ppl_teacher"]
    assert len(lines(err, "did not reproduce")) == 1 and "model.safetensors" in err
    monkeypatch.undo()
    assert train_tiny_teacher(spec, tmp_path / "d", cache_dir=cache)["cached"] is True
    assert capsys.readouterr().err.count("did not") == 0, "the rebuilt entry is what is recorded now"
