"""Calibration data as researchers use it: named sources mixed by weight (workers.calibration.calibrate.mix_stats,
the per-source statistics file) and instruction records rendered by a chat template (workers.core.data)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from families_cases import V, make_teacher

from workers.calibration.calibrate import (
    STAT_FIELDS,
    collect_stats,
    load_source_stats,
    load_stats,
    mix_stats,
    save_source_stats,
    save_stats,
    source_weights,
    stats_metadata,
)
from workers.core.data import DataSpec, load_texts, token_windows
from workers.core.types import LayerStats
from workers.families import get_adapter

E, H = 4, 3
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def synthetic(n_tokens: int, seed: int, max_scale: float = 1.0) -> LayerStats:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.rand(*shape, generator=g, dtype=torch.float64) * n_tokens  # noqa: E731
    return LayerStats(
        n_tokens=n_tokens,
        count=r(E),
        sum_p=r(E),
        sum_p_sel=r(E),
        sum_sq=r(E),
        sum_gnorm_sel=r(E),
        sum_norm_sel=r(E),
        gram=r(E, E),
        sum_pnorm_sel=r(E),
        max_norm_sel=r(E) * max_scale,
        sum_out=r(E, H),
        gram_p=r(E, E),
        sum_xx=r(H, H),
    )


def assert_same(a: LayerStats, b: LayerStats, exact: bool = True) -> None:
    assert a.n_tokens == b.n_tokens
    for name in STAT_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if exact:  # exact: one source's mix is its own objects, and a safetensors round trip copies bytes
            assert x.dtype == y.dtype and torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12, msg=name)


# ---- mixing ---------------------------------------------------------------------------------------
def test_mixture_equals_a_hand_computed_reweighting():
    a, b = synthetic(10, 1), synthetic(30, 2)
    mixed = mix_stats({"a": {0: a}, "b": {0: b}}, {"a": 3.0, "b": 1.0})[0]
    # λ_a = (3/4)·40/10 = 3, λ_b = (1/4)·40/30 = 1/3
    assert mixed.n_tokens == 40
    for name in STAT_FIELDS:
        want = (
            torch.maximum(getattr(a, name), getattr(b, name))
            if name == "max_norm_sel"
            else 3 * getattr(a, name) + getattr(b, name) / 3
        )
        torch.testing.assert_close(getattr(mixed, name), want, rtol=1e-14, atol=0, msg=name)
    # per token: the weights' shares of each source's own average (CP's numerator and denominator alike)
    torch.testing.assert_close(mixed.sum_p_sel / 40, 0.75 * a.sum_p_sel / 10 + 0.25 * b.sum_p_sel / 30)
    torch.testing.assert_close(
        mixed.sum_p_sel / mixed.count,
        (0.75 * a.sum_p_sel / 10 + 0.25 * b.sum_p_sel / 30) / (0.75 * a.count / 10 + 0.25 * b.count / 30),
    )


def test_a_single_source_is_exact():
    a = {0: synthetic(10, 1), 3: synthetic(10, 5)}
    b = {0: synthetic(7, 2), 3: synthetic(7, 6)}
    for weights in ({"a": 0.3}, {"a": 5.0}):
        mixed = mix_stats({"a": a}, weights)
        for layer in a:
            assert_same(mixed[layer], a[layer])
    mixed = mix_stats({"a": a, "b": b}, {"a": 2.0, "b": 0.0})  # weight 0: left out, of N too
    for layer in a:
        assert_same(mixed[layer], a[layer])


def test_each_source_contributes_and_its_weight_moves_the_mix():
    """Two sources route to different experts: the mix is neither alone, does not depend on the order
    the sources are listed in, and a source's larger weight moves the selection frequencies towards it."""
    a, b = synthetic(20, 1), synthetic(50, 2)
    a.count = torch.tensor([20.0, 0, 20, 0], dtype=torch.float64)  # a always routes to experts 0 and 2
    b.count = torch.tensor([0.0, 50, 0, 50], dtype=torch.float64)  # b to 1 and 3
    per = {"a": {0: a}, "b": {0: b}}

    def freq(wa: float, wb: float, order=("a", "b")) -> torch.Tensor:
        st = mix_stats({k: per[k] for k in order}, {"a": wa, "b": wb})[0]
        return st.count / st.n_tokens

    f = freq(1, 1)
    assert not torch.allclose(f, a.count / 20) and not torch.allclose(f, b.count / 50)
    torch.testing.assert_close(f, torch.full((E,), 0.5, dtype=torch.float64))
    torch.testing.assert_close(freq(1, 1, order=("b", "a")), f)  # no source wins by coming last
    torch.testing.assert_close(freq(3, 1), torch.tensor([0.75, 0.25, 0.75, 0.25], dtype=torch.float64))
    assert (freq(3, 1)[[0, 2]] > f[[0, 2]]).all() and (freq(1, 3)[[0, 2]] < f[[0, 2]]).all()
    mixed = mix_stats(per, {"a": 1, "b": 1})[0]
    for name in ("sum_p", "gram", "sum_xx", "sum_out"):
        m = getattr(mixed, name)
        assert not torch.allclose(m, getattr(a, name) * 70 / 20) and not torch.allclose(
            m, getattr(b, name) * 70 / 50
        )
    big = synthetic(20, 3, max_scale=100.0)  # max_norm_sel is a max over the sources with weight
    torch.testing.assert_close(
        mix_stats({"a": {0: big}, "b": {0: b}}, {"a": 1, "b": 1})[0].max_norm_sel,
        torch.maximum(big.max_norm_sel, b.max_norm_sel),
    )
    torch.testing.assert_close(
        mix_stats({"a": {0: big}, "b": {0: b}}, {"a": 0, "b": 1})[0].max_norm_sel, b.max_norm_sel
    )


def test_token_proportional_weights_equal_one_pass_over_all_sources():
    """w_s ∝ N_s gives λ_s = 1: the mix is the statistics of one pass over every source's tokens."""
    model = make_teacher("qwen3_moe", seed=3, dtype=torch.float64, experts_implementation="eager")
    adapter = get_adapter(model)
    g = torch.Generator().manual_seed(4)
    ba = [(torch.randint(3, V // 2, (2, 7), generator=g), torch.ones(2, 7, dtype=torch.long))]
    bb = [
        (torch.randint(V // 2, V, (3, 5), generator=g), torch.ones(3, 5, dtype=torch.long)) for _ in range(2)
    ]
    sa, sb = (collect_stats(model, adapter, b, chunk_tokens=8) for b in (ba, bb))
    joint = collect_stats(model, adapter, ba + bb, chunk_tokens=8)
    mixed = mix_stats({"a": sa, "b": sb}, {"a": 14.0, "b": 30.0})
    for layer in joint:
        assert_same(mixed[layer], joint[layer], exact=False)
    assert not torch.allclose(
        mix_stats({"a": sa, "b": sb}, {"a": 1, "b": 1})[layer].count, joint[layer].count
    )


def test_mixing_errors_are_one_line():
    per = {"a": {0: synthetic(10, 1)}, "b": {0: synthetic(10, 2)}}
    for weights, match in [
        ({"a": 1.0}, "weights name"),
        ({"a": 1, "b": 1, "c": 1}, "weights name"),
        ({"a": -1, "b": 1}, "weight of source 'a'"),
        ({"a": float("nan"), "b": 1}, "finite"),
        ({"a": 0, "b": 0}, "every weight is 0"),
    ]:
        with pytest.raises(ValueError, match=match) as e:
            mix_stats(per, weights)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="layers"):
        mix_stats({"a": {0: synthetic(10, 1)}, "b": {1: synthetic(10, 2)}}, {"a": 1, "b": 1})
    with pytest.raises(ValueError, match="no tokens"):
        mix_stats({"a": {0: synthetic(10, 1)}, "b": {0: synthetic(0, 2)}}, {"a": 1, "b": 1})


# ---- the file ------------------------------------------------------------------------------------
def test_sources_are_stored_apart_with_their_weights_and_token_counts(tmp_path):
    per = {
        "web": {0: synthetic(12, 1), 2: synthetic(12, 2)},
        "chat": {0: synthetic(40, 3), 2: synthetic(40, 4)},
    }
    path = tmp_path / "stats.safetensors"
    save_source_stats(per, {"web": 2.0, "chat": 1.0}, path, metadata={"teacher": "tiny"})
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        keys = set(fh.keys())
    assert "source.web.layer.0.count" in keys and "source.chat.layer.2.sum_xx" in keys
    assert not any(k.startswith("layer.") for k in keys)
    meta = stats_metadata(path)
    assert json.loads(meta["sources"]) == {
        "web": {"weight": 2.0, "n_tokens": 12},
        "chat": {"weight": 1.0, "n_tokens": 40},
    }
    assert meta["teacher"] == "tiny" and source_weights(path) == {"web": 2.0, "chat": 1.0}
    back = load_source_stats(path)
    assert sorted(back) == ["chat", "web"]
    for name in per:
        for layer in per[name]:
            assert_same(back[name][layer], per[name][layer])
    stored = load_stats(path)  # the stored weights
    want = mix_stats(per, {"web": 2.0, "chat": 1.0})
    for layer in want:
        assert_same(stored[layer], want[layer], exact=False)
    only_chat = load_stats(path, weights={"web": 0.0, "chat": 1.0})  # reweighted when loaded
    assert_same(only_chat[2], per["chat"][2])
    with pytest.raises(ValueError, match="weights name"):
        load_stats(path, weights={"web": 1.0})
    with pytest.raises(ValueError, match="source name"):
        save_source_stats({"a.b": per["web"]}, {"a.b": 1.0}, tmp_path / "x.safetensors")


def test_a_file_without_sources_still_loads(tmp_path):
    old = {0: synthetic(9, 1), 1: synthetic(9, 2)}
    path = tmp_path / "old.safetensors"
    save_stats(old, path)
    assert source_weights(path) == {"default": 1.0}
    back = load_source_stats(path)
    assert list(back) == ["default"]
    for layer in old:
        assert_same(back["default"][layer], old[layer])
        assert_same(load_stats(path)[layer], old[layer])


# ---- chat records ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from workers.tiny.tokenizer import train_tokenizer

    docs = [f"<|user|>question {i}\n<|assistant|>the answer is {i}\n" for i in range(60)]
    return train_tokenizer(docs, 300, tmp_path_factory.mktemp("tok"))


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chat_records_are_rendered_with_the_template(tmp_path, tok):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    msgs = _jsonl(
        tmp_path / "m.jsonl",
        [
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ]
            },
            {"messages": [{"role": "user", "content": "2+2?"}]},
        ],
    )
    spec = DataSpec(
        source="jsonl", path=msgs, format="chat", messages_field="messages", chat_template=str(template)
    )
    assert load_texts(spec, tok=tok) == [
        "<|system|>be brief\n<|user|>hi\n<|assistant|>hello\n",
        "<|user|>2+2?\n<|assistant|>",
    ]  # no answer: the generation prompt
    pr = _jsonl(tmp_path / "p.jsonl", [{"q": "why?", "a": "because"}])
    spec = DataSpec(
        source="jsonl",
        path=pr,
        format="chat",
        prompt_field="q",
        response_field="a",
        chat_template=str(template),
    )
    assert load_texts(spec, tok=tok) == ["<|user|>why?\n<|assistant|>because\n"]
    # windows of the rendered text: what the calibration pass sees
    wins = token_windows(tok, load_texts(spec, tok=tok) * 8, 8, None, seed=0)
    assert "<|user|>why?" in tok.decode(wins.flatten().tolist())


def test_a_tokenizer_template_is_used_unless_a_file_is_given(tmp_path, tok):
    path = _jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    spec = DataSpec(source="jsonl", path=path, format="chat", messages_field="messages")
    with pytest.raises(ValueError, match="^chat_template: tokenizer .* has no chat template") as e:
        load_texts(spec, tok=tok)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="^format: 'chat' is rendered with the teacher's tokenizer"):
        load_texts(spec)
    own = copy.deepcopy(tok)
    own.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    assert load_texts(spec, tok=own) == ["[user] hi"]
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    spec = DataSpec(
        source="jsonl", path=path, format="chat", messages_field="messages", chat_template=str(template)
    )
    assert load_texts(spec, tok=own) == ["<|user|>hi\n<|assistant|>"]  # the file overrides the tokenizer's
    missing = DataSpec(
        source="jsonl", path=path, format="chat", messages_field="messages", chat_template="/no.jinja"
    )
    with pytest.raises(ValueError, match="^chat_template: no such file"):
        load_texts(missing, tok=own)


def test_malformed_chat_records_and_settings_are_one_line(tmp_path, tok):
    path = _jsonl(
        tmp_path / "bad.jsonl",
        [{"messages": [{"role": "user", "content": "ok"}]}, {"messages": [{"role": "user"}]}],
    )
    spec = DataSpec(source="jsonl", path=path, format="chat", messages_field="messages", chat_template=None)
    tok2 = copy.deepcopy(tok)
    tok2.chat_template = TEMPLATE
    with pytest.raises(ValueError, match=r"bad.jsonl:2: messages_field 'messages' is missing or not"):
        load_texts(spec, tok=tok2)
    spec = DataSpec(source="jsonl", path=path, format="chat", prompt_field="q")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: prompt_field 'q' is missing"):
        load_texts(spec, tok=tok2)
    for kw, match in [
        ({"source": "tiny", "format": "chat", "messages_field": "m"}, "^format: 'chat' reads"),
        ({"format": "chat"}, "^messages_field: format 'chat' needs"),
        (
            {"format": "chat", "messages_field": "m", "prompt_field": "p"},
            "^messages_field: give messages_field or prompt_field, not both",
        ),
        ({"format": "chat", "messages_field": "m", "response_field": "a"}, "^response_field: only"),
        ({"messages_field": "m"}, "^messages_field: only with format 'chat'"),
        ({"chat_template": "t.jinja"}, "^chat_template: only with format 'chat'"),
        ({"format": "markdown"}, "^format='markdown'"),
    ]:
        with pytest.raises(ValueError, match=match):
            DataSpec(**{"source": "jsonl", "path": path, **kw})


# ---- a sweep --------------------------------------------------------------------------------------------
SWEEP = """\
name: mixture
description: a tiny teacher calibrated on two sources, one of them chat records
teacher:
  source: tiny
  tiny: {{experts: 4, top_k: 2, hidden: 16, layers: 2, heads: 2, kv_heads: 1, moe_intermediate: 16, vocab: 300,
         steps: 3, warmup: 1, batch_size: 4, seq_len: 32, corpus_chars: 100000, eval_windows: 4}}
calibration:
  sources:
    web: {{data: {{source: jsonl, path: {web}}}, weight: 3.0}}
    chat: {{data: {{source: jsonl, path: {chat}, format: chat, messages_field: messages, chat_template: {template}}},
           weight: 1.0, n_samples: 4}}
  n_samples: 8
  seq_len: 32
  batch_size: 4
grid: {{scoring: [CP], grouping: [RR], K: [2, 3]}}
ppl: {{data: {{source: tiny, split: test}}, seq_len: 32, max_windows: 2}}
select: null
"""


def test_a_sweep_with_two_sources_runs_end_to_end(tmp_path, monkeypatch):
    from sweep_runs import launch_serial

    from db.store import Store
    from orchestrator.spec import load_spec

    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    web = _jsonl(
        tmp_path / "web.jsonl",
        [{"text": f"The river {i} runs past the old mill and the town." * 3} for i in range(40)],
    )
    chat = _jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": f"def f{i}(x): return x?"},
                    {"role": "assistant", "content": f"It returns x ({i})."},
                ]
            }
            for i in range(40)
        ],
    )
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    sweep = tmp_path / "mixture.yaml"
    sweep.write_text(SWEEP.format(web=web, chat=chat, template=template))
    spec, path, text = load_spec(str(sweep))
    store = Store(f"sqlite:///{tmp_path}/r.db")
    assert launch_serial(spec, text, store, path) == 0
    ((job_id, outputs),) = store.query("SELECT id, outputs_json FROM jobs WHERE stage = 'calibrate'")[1]
    out = json.loads(outputs)
    assert out["sources"] == {
        "web": {"n_tokens": 8 * 32, "weight": 3.0, "n_samples": 8},
        "chat": {"n_tokens": 4 * 32, "weight": 1.0, "n_samples": 4},
    }
    assert out["n_tokens"] == 12 * 32
    metrics = store.query(
        "SELECT task, value FROM metrics WHERE job_id = :j AND name = 'calib_tokens'", {"j": job_id}
    )[1]
    assert sorted(metrics) == [("chat", 128.0), ("web", 256.0)]
    per = load_source_stats(out["stats"])
    assert sorted(per) == ["chat", "web"] and all(sorted(s) == out["layers"] for s in per.values())
    # exact: a distinctness check: the two sources' own counts differ
    assert not torch.equal(per["web"][out["layers"][0]].count, per["chat"][out["layers"][0]].count)
    mixed, want = load_stats(out["stats"]), mix_stats(per, {"web": 3.0, "chat": 1.0})
    for layer in want:
        assert_same(mixed[layer], want[layer], exact=False)
    ppl = store.query("SELECT ppl_pre FROM results WHERE kind = 'moe2dense'")[1]
    assert len(ppl) == 2 and all(v is not None for (v,) in ppl)


def test_a_mixture_samples_tokens_in_the_proportions_of_its_weights():
    """Reconstruction selection sees a mixture's token sample in the weights' proportions, and each kept
    token's window and position still point at the token it came from."""
    import torch

    from workers.calibration.calibrate import mix_samples

    def sample(n_tokens: int, n_windows: int, fill: float) -> dict[str, torch.Tensor]:
        ids = torch.arange(n_windows * 8).reshape(n_windows, 8) + int(fill * 1000)
        window, pos = torch.arange(n_tokens) % n_windows, torch.arange(n_tokens) % 8
        return {
            "x": torch.full((n_tokens, 3), fill),
            "p": torch.full((n_tokens, 4), fill),
            "ids": ids,
            "mask": torch.ones_like(ids),
            "window": window,
            "pos": pos,
        }

    a, b = sample(30, 5, 1.0), sample(20, 4, 2.0)
    mixed = mix_samples({"a": a, "b": b}, {"a": 1.0, "b": 2.0})
    # exact: the sampled rows are copies of the constant fills 1.0 and 2.0, no arithmetic
    assert mixed["x"].shape == (30, 3) and int((mixed["x"][:, 0] == 1.0).sum()) == 10
    assert int((mixed["x"][:, 0] == 2.0).sum()) == 20  # b's share is 20 of 30: all it has
    assert mixed["ids"].shape == (9, 8)
    token = mixed["ids"][
        mixed["window"], mixed["pos"]
    ]  # every kept token points into its own source's windows
    assert bool(((token >= 2000) == (mixed["x"][:, 0] == 2.0)).all())
    assert mix_samples({"a": a, "b": None}, {"a": 1.0, "b": 1.0}) is None
