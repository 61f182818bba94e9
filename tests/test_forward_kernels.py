"""The kernel of each forward: chosen by width, scoped to the call, lossless; the honest baseline; draft passes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_dflash2 import cost_model_dflash2 as cm
from hf_dflash2 import kernels_dflash2 as kd
from hf_dflash2 import speculative_generate, use_linear_kernel
from hf_dflash2.cost_model_dflash2 import CostModel
from hf_dflash2.evaluation.bench import (
    PLAIN_CONFIGURATIONS,
    Runner,
    fastest_baseline,
    plain_configuration,
    speed_bound,
    summarize,
)

from .conftest import tiny_drafter, tiny_target
from .test_generation import OracleDrafter, plain

needs_onednn = pytest.mark.skipif(not kd.onednn_available(), reason="this torch build has no oneDNN")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DFLASH2_CACHE", str(tmp_path / "cache"))


def _forwards(*models) -> dict:
    return {id(m): m.__dict__.get("forward") for model in models for m in model.modules()
            if isinstance(m, torch.nn.Linear)}


@pytest.fixture
def kernels_used(monkeypatch):
    """oneDNN faster only at 4 rows and more (so a plain step and a verify differ); records each switch."""
    monkeypatch.setattr(kd, "onednn_speedup", lambda module, rows=(1, 16): 2.0 if rows[0] >= 4 else 0.5)
    used = []
    use = kd.KernelSwitch.use

    def spy(self, kernel, only=None):
        used.append(kernel)
        return use(self, kernel, only)

    monkeypatch.setattr(kd.KernelSwitch, "use", spy)
    return used


def test_forward_kernels_choose_by_width_from_the_injected_speedups():
    target = tiny_target(vocab_size=96, layers=2)
    drafter = tiny_drafter(target, block_size=4)
    speedups = {1: 0.8, 4: 1.2, 16: 1.5}  # per row of a batch of 2: rows 2, 8, 32; the draft pass at 8 rows
    probe = lambda module, rows: speedups.get(rows // 2, 1.0)  # noqa: E731
    with kd.ForwardKernels(target, drafter, 2, 4, "auto", speedup=probe) as kernels:
        if not kernels.active:
            pytest.skip("oneDNN cannot pack here")
        assert kernels.target_kernels == {1: "default", 4: "onednn", 16: "onednn"}
        assert kernels.draft_kernel == "onednn"  # 8 rows = 4 per row of the batch
        assert kernels.kernel_for_rows(2) == "default" and kernels.kernel_for_rows(6) == "onednn"
        assert kernels.kernel_for_rows(2 * 300) == "onednn"  # a prefill: the widest probe decides
        # both models report the call's choices, so a cost model's key is the same whichever layer is switched
        assert target.__dict__["_dflash2_forward_kernels"] == kernels.describe()
        assert cm.linear_kernel_of(drafter) == cm.linear_kernel_of(target) == kernels.describe()
    assert "_dflash2_forward_kernels" not in target.__dict__ and not target._forward_pre_hooks
    assert "_dflash2_forward_kernels" not in drafter.__dict__ and not drafter._forward_pre_hooks


def test_a_bad_kernel_name_is_refused_by_name_before_any_work():
    target = tiny_target(vocab_size=96, layers=2)
    drafter = tiny_drafter(target, block_size=4)
    with pytest.raises(ValueError, match="linear_kernel must be one of .* got 'mkl'"):
        speculative_generate(target, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=4, linear_kernel="mkl")


@needs_onednn
@pytest.mark.parametrize("user_packed", [False, True])
def test_after_a_call_that_switched_kernels_the_models_are_as_before_and_greedy_is_identical(kernels_used,
                                                                                             user_packed):
    target = tiny_target(vocab_size=96, layers=3)
    drafter = tiny_drafter(target, block_size=4)
    if user_packed:  # a caller who chose a kernel keeps it after the call
        use_linear_kernel(target, "onednn")
    before = _forwards(target, drafter)
    hooks = (dict(target._forward_pre_hooks), dict(drafter._forward_pre_hooks))
    ids = torch.randint(2, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    expected = plain(target, ids, 24)
    out = speculative_generate(target, drafter, ids, max_new_tokens=24, ngram_size=0)
    assert {"default", "onednn"} <= set(kernels_used)  # the call did switch, forward by forward
    assert torch.equal(out.sequences, expected)  # fp32: the same text as plain greedy on the model as loaded
    assert _forwards(target, drafter) == before
    assert (dict(target._forward_pre_hooks), dict(drafter._forward_pre_hooks)) == hooks
    assert "_dflash2_forward_kernels" not in target.__dict__


@needs_onednn
def test_generate_with_the_head_switches_kernels_and_restores_the_models(kernels_used):
    target = tiny_target(vocab_size=96, layers=3)
    drafter = tiny_drafter(target, block_size=4)
    ids = torch.randint(2, 96, (1, 7), generator=torch.Generator().manual_seed(4))
    expected = plain(target, ids, 20)
    before = _forwards(target, drafter)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False)
    assert {"default", "onednn"} <= set(kernels_used)
    assert torch.equal(out, expected)
    assert _forwards(target, drafter) == before and not target._forward_pre_hooks and not drafter._forward_pre_hooks
    assert "_dflash2_forward_kernels" not in target.__dict__


@needs_onednn
def test_linear_kernel_none_leaves_the_model_as_loaded(kernels_used):
    target = tiny_target(vocab_size=96, layers=2)
    drafter = tiny_drafter(target, block_size=4)
    speculative_generate(target, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=8, linear_kernel=None)
    assert kernels_used == []


def _timings(seconds: dict[str, list[float]], tokens: int = 10) -> dict:
    return {m: {"tokens": [tokens] * len(s), "seconds": list(s)} for m, s in seconds.items()}


def test_the_baseline_is_the_faster_plain_greedy_configuration():
    oneDNN_faster = _timings({"ar": [2.0, 2.0, 2.0], "ar_onednn": [1.0, 1.2, 0.9], "dflash2_fast": [0.5, 0.6, 0.5]})
    assert fastest_baseline(oneDNN_faster) == "ar_onednn"
    summary = summarize(oneDNN_faster)
    assert summary["ar_onednn"]["is_baseline"] and not summary["ar"]["is_baseline"]
    assert summary["dflash2_fast"]["speedup_vs_ar"] == pytest.approx(1.0 / 0.5)  # over the fastest greedy
    assert summary["dflash2_fast"]["speedup_vs_as_loaded"] == pytest.approx(2.0 / 0.5)
    assert summary["ar"]["speedup_vs_ar"] == pytest.approx(0.5)

    default_faster = _timings({"ar": [1.0, 1.1, 1.0], "ar_onednn": [1.5, 1.5, 1.4], "dflash2_fast": [0.5, 0.5, 0.5]})
    assert fastest_baseline(default_faster) == "ar"
    assert summarize(default_faster)["dflash2_fast"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert fastest_baseline(_timings({"dflash2_fast": [1.0]})) is None

    packed_faster = _timings({"ar": [2.0, 2.0], "ar_onednn": [1.5, 1.5], "ar_packed": [1.0, 1.1],
                              "dflash2_fast": [0.8, 0.8]})
    assert fastest_baseline(packed_faster) == "ar_packed"  # the attention is no part of the speedup
    assert summarize(packed_faster)["dflash2_fast"]["speedup_vs_ar"] == pytest.approx(1.05 / 0.8)


@needs_onednn
def test_a_plain_configuration_runs_as_it_says_and_leaves_the_model_as_it_was(kernels_used):
    target = tiny_target(vocab_size=96, layers=3)  # grouped-query attention: 4 query heads, 2 key/value heads
    attention, before = target.config._attn_implementation, _forwards(target)
    ids = torch.randint(2, 96, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: the packed attention then runs with a mask on every forward
    expected = plain(target, ids, 16, attention_mask=mask)
    seen = []
    target.register_forward_pre_hook(lambda module, args: seen.append(module.config._attn_implementation))
    for method, configuration in PLAIN_CONFIGURATIONS.items():
        kernels_used.clear()
        seen.clear()
        with torch.no_grad(), plain_configuration(target, method, ids.shape[0]):
            out = target.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert torch.equal(out, expected), method  # fp32: every configuration decodes the same text
        assert set(seen) == {"packed_gqa_sdpa" if configuration.packed_attention else attention}, method
        assert ("onednn" in kernels_used) == (configuration.linear_kernel in ("onednn", "auto")), method
        # "auto" chose per width: oneDNN for the prefill's 14 rows, the default kernel for a 2-row step
        assert ("default" in kernels_used) == (configuration.linear_kernel == "auto"), method
        assert target.config._attn_implementation == attention and _forwards(target) == before, method
    runner = Runner(target, SimpleNamespace(pad_token_id=0), {}, 4, temperature=0.0)
    assert runner.supports("ar_packed", 1) is None
    target.config._attn_implementation = "eager"
    assert "packed grouped-query attention" in runner.supports("ar_packed", 1)


def test_the_bound_counts_the_draft_passes_and_the_chosen_verifies():
    costs = {"verify_seconds": [0.10, 0.12, 0.14, 0.16], "draft_seconds": 0.05}
    # 10 forwards, 4 with a draft pass; verified 0 drafts 6 times, 3 drafts 4 times; 20 tokens committed
    stats = [{"verify_forwards": 10, "draft_passes": 4, "committed": 20, "verify_length_histogram": [6, 0, 0, 4],
              "costs": costs}]
    bound = speed_bound(stats, step_seconds=0.1)
    verify = (6 * 0.10 + 4 * 0.16) / 10
    assert bound["tau"] == pytest.approx(2.0) and bound["drafted_share"] == pytest.approx(0.4)
    assert bound["c_d"] == pytest.approx(0.5) and bound["v"] == pytest.approx(verify / 0.1)
    assert bound["bound"] == pytest.approx(2.0 / (0.5 * 0.4 + verify / 0.1))
    assert speed_bound([{**stats[0], "costs": None}], 0.1) is None
    # a second prompt, long: its own cost model (verifies twice as dear) counts for its own rounds
    long = {"verify_forwards": 10, "draft_passes": 10, "committed": 30, "verify_length_histogram": [0, 0, 0, 10],
            "costs": {"verify_seconds": [0.20, 0.24, 0.28, 0.32], "draft_seconds": 0.05}}
    both = speed_bound([*stats, long], step_seconds=0.1)
    verify_both = (6 * 0.10 + 4 * 0.16 + 10 * 0.32) / 20
    assert both["v"] == pytest.approx(verify_both / 0.1) and both["drafted_share"] == pytest.approx(0.7)
    assert both["bound"] == pytest.approx(2.5 / (0.5 * 0.7 + verify_both / 0.1))


def test_the_bound_over_a_whole_call_counts_the_prefill_both_sides_pay():
    costs = {"verify_seconds": [0.10, 0.10], "draft_seconds": 0.0}
    # tau 2 at the cost of a plain step (0.1 s): the decoding's bound is 2x
    stats = [{"verify_forwards": 10, "draft_passes": 0, "committed": 20, "verify_length_histogram": [0, 10],
              "costs": costs}]
    decode_only = speed_bound(stats, step_seconds=0.1)
    assert decode_only["bound"] == pytest.approx(2.0) == decode_only["decode_bound"]
    # the baseline's whole call: 20 tokens at 0.2 s = 4 s, of which a 2 s prefill and 2 s of decoding
    with_prefill = speed_bound(stats, step_seconds=0.2, prefill_seconds=2.0)
    assert with_prefill["v"] == pytest.approx(1.0) and with_prefill["decode_bound"] == pytest.approx(2.0)
    assert with_prefill["bound"] == pytest.approx((2.0 + 2.0) / (2.0 + 1.0))
    assert with_prefill["prefill_share"] == pytest.approx(0.5)
    # batch 2: a plain step writes 2 tokens, so 40 tokens (tau 2 a row) at 0.2 s a step are again 4 s a call
    batched = speed_bound([{**stats[0], "committed": 40}], step_seconds=0.2, batch_size=2, prefill_seconds=2.0)
    assert batched["decode_bound"] == pytest.approx(2.0) and batched["bound"] == pytest.approx(4.0 / 3.0)
    # the bench passes the baseline's own prefill, the mean over its prompts: 20 tokens in 1.0 s, 0.5 s prefill
    timings = _timings({"ar_onednn": [1.0], "dflash2_fast": [0.5]}, tokens=20)
    timings["ar_onednn"]["prefill_seconds"] = [0.5]
    timings["dflash2_fast"]["stats_list"] = [{**stats[0], "rounds": 10, "verified_accepted": [[0, 0], [0, 10]],
                                              "costs": {"verify_seconds": [0.025, 0.025], "draft_seconds": 0.0}}]
    summary = summarize(timings)["dflash2_fast"]["speed_bound"]  # a plain step: 0.5 s / 20 tokens = 0.025 s
    assert summary["decode_bound"] == pytest.approx(2.0)
    assert summary["bound"] == pytest.approx(1.0 / (0.5 + 0.25))


def test_a_weak_drafter_the_policy_stops_verifying_costs_fewer_draft_passes():
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=5)
    ids = torch.randint(2, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    expected = plain(target, ids, 60)
    cost = CostModel([1.0, 1.3, 1.5, 1.7, 1.9], 0.8)  # verifying and drafting are dear, as on a CPU
    passes = {}
    for adaptive in (True, False):
        weak = OracleDrafter(drafter, expected[:, 6:], torch.tensor([6]), corrupt_every=1)  # never right
        out = speculative_generate(target, weak, ids, max_new_tokens=60, cost_model=cost, ngram_size=0,
                                   adaptive=adaptive)
        assert torch.equal(out.sequences, expected)
        assert out.stats.draft_passes == weak.calls  # the counter counts the head's forwards
        passes[adaptive] = (weak.calls, out.stats.verify_forwards)
    (adaptive_passes, adaptive_forwards), (fixed_passes, fixed_forwards) = passes[True], passes[False]
    assert fixed_passes >= fixed_forwards  # without the policy every round drafts
    assert adaptive_passes < 0.3 * adaptive_forwards  # the policy stops paying for the draft
