"""The verify cost model: monotone repair, measurement, a cache per key, bad cache files ignored."""

from __future__ import annotations

import json

import pytest
import torch

from hf_dflash2 import cost_model_dflash2 as cm

from .conftest import tiny_drafter, tiny_target


def test_monotone_repair_is_the_least_squares_non_decreasing_fit():
    assert cm.monotone_repair([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert cm.monotone_repair([5.0, 1.0, 1.0]) == [pytest.approx(7 / 3)] * 3
    assert cm.monotone_repair([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    values = torch.rand(40, generator=torch.Generator().manual_seed(0)).tolist()
    repaired = cm.monotone_repair(values)
    assert all(a <= b for a, b in zip(repaired, repaired[1:]))
    assert sum(repaired) == pytest.approx(sum(values))  # pooling keeps block means
    model = cm.CostModel([0.02, 0.03, 0.025, 0.04], 0.01)
    assert model.verify_seconds == [0.02, 0.0275, 0.0275, 0.04]
    with pytest.raises(ValueError, match="positive finite"):
        cm.CostModel([0.02, float("nan")], 0.01)
    with pytest.raises(ValueError, match="positive finite"):
        cm.CostModel([0.02, 0.03], -1.0)


@pytest.fixture
def pair():
    target = tiny_target(vocab_size=64, layers=2)
    return target, tiny_drafter(target, block_size=4)


def test_measure_gives_one_positive_monotone_cost_per_verify_length(pair):
    target, drafter = pair
    model = cm.measure_cost_model(target, drafter, batch_size=2, context_length=32, repeats=2)
    assert len(model.verify_seconds) == 4 and model.draft_seconds > 0
    assert all(0 < a <= b for a, b in zip(model.verify_seconds, model.verify_seconds[1:]))
    assert model.key["batch_size"] == 2 and model.key["block_size"] == 4 and model.key["dtype"] == "torch.float32"
    assert "| 4 |" in model.table() and "draft pass" in model.table()


@pytest.mark.parametrize("batch_size", [1, 2])
def test_measure_runs_the_targets_attention_with_a_mask_where_the_loop_has_one(pair, monkeypatch, batch_size):
    """At batch > 1 the loop's forwards usually carry padding (left-padded prompts, holes where rows accepted
    less), so SDPA gets a mask; a one-token forward timed without one runs another kernel (``enable_gqa``)."""
    target, drafter = pair
    sdpa = torch.nn.functional.scaled_dot_product_attention
    forward = target.forward
    seen, width = [], [None]  # (new tokens of the target's forward, whether SDPA got a mask)

    def spy_sdpa(*args, **kwargs):
        if width[0] is not None:
            seen.append((width[0], kwargs.get("attn_mask") is not None))
        return sdpa(*args, **kwargs)

    def spy_forward(*args, **kwargs):
        width[0] = kwargs["input_ids"].shape[1]
        try:
            return forward(*args, **kwargs)
        finally:
            width[0] = None

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy_sdpa)
    monkeypatch.setattr(target, "forward", spy_forward)
    cm.measure_cost_model(target, drafter, batch_size=batch_size, context_length=32, repeats=1)
    one_token = [masked for width, masked in seen if width == 1]
    assert one_token and len(seen) > len(one_token)
    if batch_size > 1:
        assert all(masked for _, masked in seen)
    else:  # nothing to pad: no mask for one token, as the loop's batch-1 steps run
        assert not any(one_token)


def _counting_measure(monkeypatch):
    calls = []

    def fake(target, drafter, batch_size, block_size, context_length, *args):
        calls.append((batch_size, str(next(target.parameters()).dtype)))
        key = cm.cost_key(target, drafter, batch_size, block_size, context_length)
        return cm.CostModel([0.01 * (k + 1) for k in range(block_size)], 0.004, key)

    monkeypatch.setattr(cm, "measure_cost_model", fake)
    return calls


def test_cache_is_per_device_dtype_and_shape(pair, tmp_path, monkeypatch):
    target, drafter = pair
    calls = _counting_measure(monkeypatch)
    first = cm.load_or_measure_cost_model(target, drafter, 1, cache_dir=tmp_path)
    cm._COST_MODEL_MEMO.clear()  # as in a new process: only the file can answer
    again = cm.load_or_measure_cost_model(target, drafter, 1, cache_dir=tmp_path)
    assert len(calls) == 1 and again.verify_seconds == first.verify_seconds
    files = list(tmp_path.glob("cost_model-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["device"].startswith("cpu:")
    cm.load_or_measure_cost_model(target, drafter, 8, cache_dir=tmp_path)  # another batch size
    cm.load_or_measure_cost_model(target, drafter, 1, block_size=3, cache_dir=tmp_path)  # another block
    target.to(torch.bfloat16)
    drafter.to(torch.bfloat16)
    cm.load_or_measure_cost_model(target, drafter, 1, cache_dir=tmp_path)  # another dtype
    assert calls == [(1, "torch.float32"), (8, "torch.float32"), (1, "torch.float32"), (1, "torch.bfloat16")]
    assert len(list(tmp_path.glob("cost_model-*.json"))) == 4


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps({"verify_seconds": [0.01, 0.02, 0.03, 0.04], "draft_seconds": 0.01, "key": {"device": "elsewhere"}}),
    "KEY-NEGATIVE",
    "KEY-SHORT",
])
def test_a_bad_cache_file_is_ignored_with_a_warning(pair, tmp_path, monkeypatch, content):
    target, drafter = pair
    calls = _counting_measure(monkeypatch)
    cm.load_or_measure_cost_model(target, drafter, 1, cache_dir=tmp_path)
    path = next(tmp_path.glob("cost_model-*.json"))
    key = json.loads(path.read_text())["key"]
    if content == "KEY-NEGATIVE":
        content = json.dumps({"verify_seconds": [0.01, -0.02, 0.03, 0.04], "draft_seconds": 0.01, "key": key})
    elif content == "KEY-SHORT":
        content = json.dumps({"verify_seconds": [0.01, 0.02], "draft_seconds": 0.01, "key": key})
    path.write_text(content)
    cm._COST_MODEL_MEMO.clear()  # as in a new process: read the file again
    with pytest.warns(UserWarning, match="ignoring the cost-model cache file"):
        model = cm.load_or_measure_cost_model(target, drafter, 1, cache_dir=tmp_path)
    assert len(calls) == 2 and model.verify_seconds == [0.01, 0.02, 0.03, 0.04]
    assert json.loads(path.read_text())["key"] == key  # replaced by the new measurement


def test_a_call_decides_with_costs_timed_near_its_own_context(pair, monkeypatch):
    """A verify over a long cache costs more than over 256 tokens: the call's cost model is timed at the power
    of two nearest the prompt plus half the new tokens (the prefill of the measurement kept near 4k tokens
    whatever the batch), and what the loop reports is that model."""
    from hf_dflash2 import speculative_generate

    assert [cm.cost_context_length(1, n) for n in (10, 300, 400, 700, 2100, 9000)] == [256, 256, 512, 512, 2048,
                                                                                       4096]
    assert cm.cost_context_length(8, 2100) == 512 and cm.cost_context_length(64, 100) == 64
    target, drafter = pair
    contexts = []

    def fake(target, drafter, batch_size, block_size, context_length, *args):
        contexts.append(context_length)
        key = cm.cost_key(target, drafter, batch_size, block_size, context_length)
        return cm.CostModel([0.01 * (k + 1) for k in range(block_size)], 0.004, key)

    monkeypatch.setattr(cm, "load_or_measure_cost_model", fake)
    prompt = torch.randint(1, 60, (1, 380))
    out = speculative_generate(target, drafter, prompt, max_new_tokens=100, do_sample=False)
    assert contexts == [512] and out.stats.costs["key"]["context_length"] == 512  # 380 + 100 / 2 = 430
