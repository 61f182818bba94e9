"""The feature/label store, precision auto-selection and the sparse KL loss."""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F

from hf_dflash2.cpu import linear_kernels, precision
from hf_dflash2.speculative_dflash2 import tapped_features
from hf_dflash2.training.losses import sparse_cross_entropy
from hf_dflash2.training.store import FeatureStore, StoreMeta, build_store, check_store_fields
from hf_dflash2.training.trainer import Trainer, TrainingConfig, parse_record_weights, store_sequences

from .conftest import REPO, tiny_drafter, tiny_target

LAYERS = [1, 3, 4]


def random_records(n=7, vocab=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n):
        length = int(torch.randint(12, 40, (1,), generator=generator))
        ids = torch.randint(2, vocab, (length,), generator=generator).tolist()
        records.append({"id": f"r{i}", "input_ids": ids, "response_start": 5})
    return records


def meta_for(target, top_k=8, final_hidden=False):
    return StoreMeta(
        target="tiny",
        target_layer_ids=LAYERS,
        hidden_size=target.config.hidden_size,
        vocab_size=target.config.vocab_size,
        top_k=top_k,
        final_hidden=final_hidden,
    )


def test_store_labels_equal_a_fresh_target_forward(tmp_path):
    target = tiny_target(vocab_size=64)
    records = random_records()
    store = build_store(
        target, records, FeatureStore(tmp_path / "s", meta_for(target)), tokens_per_batch=96, tokens_per_shard=50
    )
    assert len(store.shards) > 1, "the test should cover several shards"
    reopened = FeatureStore(tmp_path / "s")
    assert len(reopened) == len(records) and reopened.num_tokens == sum(len(r["input_ids"]) for r in records)
    by_id = {reopened[i]["id"]: reopened[i] for i in range(len(reopened))}
    for record in records:
        item = by_id[record["id"]]
        ids = torch.tensor([record["input_ids"]])
        with torch.no_grad():
            out = target(input_ids=ids, output_hidden_states=True)
        features = tapped_features(out.hidden_states, LAYERS)[0]
        logprobs = out.logits[0].float().log_softmax(-1)
        assert item["input_ids"].tolist() == record["input_ids"]
        assert item["response_start"] == record["response_start"]
        torch.testing.assert_close(item["features"].float(), features.to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(item["topk_ids"][:, 0], logprobs.argmax(-1))
        expected = logprobs.gather(-1, item["topk_ids"])
        torch.testing.assert_close(item["topk_logprobs"], expected, atol=2e-3, rtol=2e-3)


def test_store_resumes_and_rejects_a_different_target(tmp_path):
    target = tiny_target(vocab_size=64)
    records = random_records(n=6)
    store = FeatureStore(tmp_path / "s", meta_for(target))
    build_store(target, records[:3], store, tokens_per_shard=10)
    build_store(target, records, FeatureStore(tmp_path / "s", meta_for(target)), tokens_per_shard=10)
    ids = [FeatureStore(tmp_path / "s")[i]["id"] for i in range(6)]
    assert sorted(ids) == sorted(r["id"] for r in records)  # each record exactly once
    with pytest.raises(ValueError, match="top_k=8"):
        FeatureStore(tmp_path / "s", meta_for(target, top_k=4))
    with pytest.raises(FileNotFoundError, match="not a feature store"):
        FeatureStore(tmp_path / "nothing")
    # a store of another format version is refused by name, for reading and for appending, and left as it was
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    (tmp_path / "s" / "meta.json").write_text(json.dumps({**meta, "version": 2, "a_later_field": 1}))
    before = sorted((p.name, p.stat().st_size) for p in (tmp_path / "s").iterdir())
    for opened in (lambda: FeatureStore(tmp_path / "s"), lambda: FeatureStore(tmp_path / "s", meta_for(target)),
                   lambda: check_store_fields(tmp_path / "s", fields={"top_k": 8})):  # the store command's early check
        with pytest.raises(ValueError, match="format version 2; this version of hf_dflash2 reads version 1"):
            opened()
    assert sorted((p.name, p.stat().st_size) for p in (tmp_path / "s").iterdir()) == before


def test_store_command_refuses_a_mismatched_store_before_the_target_loads(tmp_path, monkeypatch):
    from hf_dflash2 import assets
    from hf_dflash2.cli import main

    target = tiny_target(vocab_size=64)
    folder = tmp_path / "s"
    meta = meta_for(target)
    meta.target = "SmolLM2-135M-Instruct (offline GGUF)"  # what the command records for the default target
    build_store(target, random_records(n=2), FeatureStore(folder, meta))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def no_target(*args, **kwargs):
        raise AssertionError("the target must not load before the store's meta is checked")

    monkeypatch.setattr(assets, "load_target", no_target)
    store = ["store", "--output", str(folder), "--mixed-precision", "fp32", "--top-k", "8",
             "--target-layer-ids", ",".join(map(str, LAYERS))]
    with pytest.raises(SystemExit, match=r"built with final_hidden=False, not True"):
        main([*store, "--final-hidden"])
    with pytest.raises(SystemExit, match=r"built with top_k=8, not 32"):
        main([*store[:-4], "--top-k", "32"])
    with pytest.raises(SystemExit, match=r"built with target_layer_ids=\[1, 3, 4\], not \[1, 2, 4\]"):
        main([*store[:-2], "--target-layer-ids", "1,2,4"])
    with pytest.raises(SystemExit, match=r"built with target='SmolLM2-135M-Instruct \(offline GGUF\)', not 'other/lm'"):
        main([*store, "--target", "other/lm"])
    for matching in (store, store[:-2]):  # a matching store (layers given or not) gets as far as the target
        with pytest.raises(AssertionError, match="must not load"):
            main(matching)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # nothing written


def test_a_token_cap_that_cuts_the_sources_short_says_so(tmp_path, caplog):
    target = tiny_target(vocab_size=64)
    records = random_records(n=6)
    cap = sum(len(r["input_ids"]) for r in records[:3])
    with caplog.at_level("WARNING", logger="hf_dflash2.training.store"):
        store = build_store(target, records, FeatureStore(tmp_path / "s", meta_for(target)), max_tokens=cap)
    left_out_tokens = sum(len(r["input_ids"]) for r in records[3:])
    assert len(store) == 3
    assert f"leaves out 3 of the sources' records ({left_out_tokens} tokens)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_dflash2.training.store"):
        build_store(target, records, FeatureStore(tmp_path / "s", meta_for(target)), max_tokens=10_000)
    assert len(FeatureStore(tmp_path / "s")) == 6 and "leaves out" not in caplog.text


def test_store_sequences_keep_only_the_chosen_records(tmp_path, monkeypatch):
    target = tiny_target(vocab_size=64)
    records = random_records(n=6)
    for i, record in enumerate(records):
        record["id"] = f"{'regen' if i % 3 == 0 else 'sharegpt'}/{i}"
    store = build_store(
        target, records, FeatureStore(tmp_path / "s", meta_for(target)), tokens_per_batch=48, tokens_per_shard=30
    )
    assert len(store.shards) > 1
    kept = store_sequences(store, 512, {"regen/": 1})
    assert sorted(store[s["store_index"]]["id"] for s in kept) == ["regen/0", "regen/3"]
    assert len(store_sequences(store, 512)) == 6
    with pytest.raises(ValueError, match=r"'code/'.*'regen/', 'sharegpt/'"):
        store_sequences(store, 512, {"regen/": 1, "code/": 1})
    # A weight repeats a prefix's records per epoch; the longest matching prefix decides.
    weighted = store_sequences(store, 512, parse_record_weights("regen/,regen/3=3,sharegpt/=2"))
    counts = collections.Counter(store[s["store_index"]]["id"] for s in weighted)
    assert counts == {"regen/0": 1, "regen/3": 3, "sharegpt/1": 2, "sharegpt/2": 2, "sharegpt/4": 2, "sharegpt/5": 2}
    for bad in ["regen/=0", "regen/=two", "=2", "regen/=-1"]:
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_record_weights(bad)

    from hf_dflash2 import assets
    from hf_dflash2.cli import main

    def no_target(*args, **kwargs):
        raise AssertionError("the target must not load before --records is checked")

    monkeypatch.setattr(assets, "load_target", no_target)
    train = ["train", "--output", str(tmp_path / "run"), "--mixed-precision", "fp32"]
    with pytest.raises(SystemExit, match=r"'code/'.*'regen/', 'sharegpt/'"):
        main([*train, "--store", str(tmp_path / "s"), "--records", "code/"])
    with pytest.raises(SystemExit, match="'regen/=0' is not PREFIX or PREFIX=N"):
        main([*train, "--store", str(tmp_path / "s"), "--records", "regen/=0"])
    with pytest.raises(SystemExit, match="--records ' , '"):
        main([*train, "--store", str(tmp_path / "s"), "--records", " , "])
    (tmp_path / "regen.jsonl").write_text("")
    with pytest.raises(SystemExit, match="--data has no record ids"):
        main([*train, "--data", str(tmp_path / "regen.jsonl"), "--records", "regen/"])
    with pytest.raises(SystemExit, match="--hidden-weight 0.5: store .* keeps no final hidden states"):
        main([*train, "--store", str(tmp_path / "s"), "--hidden-weight", "0.5"])
    with pytest.raises(SystemExit, match="--hidden-weight 0.5 needs a --store built with --final-hidden, not --data"):
        main([*train, "--data", str(tmp_path / "regen.jsonl"), "--hidden-weight", "0.5"])
    with pytest.raises(SystemExit, match=r"hidden_weight must be a finite number >= 0 \(0: off\), got nan"):
        main([*train, "--store", str(tmp_path / "s"), "--hidden-weight", "nan"])


def test_a_torn_index_line_is_dropped(tmp_path):
    target = tiny_target(vocab_size=64)
    build_store(target, random_records(n=4), FeatureStore(tmp_path / "s", meta_for(target)), tokens_per_shard=10)
    index = tmp_path / "s" / "index.jsonl"
    whole = index.read_bytes()
    index.write_bytes(whole + b'{"shard": 99, "tok')
    reader = FeatureStore(tmp_path / "s")  # a reader skips the torn tail and leaves the file alone
    assert len(reader) == 4 and index.read_bytes() != whole
    writer = FeatureStore(tmp_path / "s", meta_for(target))  # the writer repairs it before appending
    assert len(writer) == 4 and index.read_bytes() == whole


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {repo!r})
    from tests.conftest import tiny_target
    from tests.test_store import random_records, meta_for
    from hf_dflash2.training.store import FeatureStore, build_store
    target = tiny_target(vocab_size=64)
    records = random_records(n=400, seed=1)
    build_store(target, records, FeatureStore(sys.argv[1], meta_for(target)), tokens_per_batch=64, tokens_per_shard=1)
    """
)


def test_kill_9_mid_write_leaves_a_readable_store(tmp_path):
    root = tmp_path / "s"
    script = tmp_path / "build.py"
    script.write_text(KILL_SCRIPT.format(repo=str(REPO)))
    process = subprocess.Popen([sys.executable, str(script), str(root)], cwd=REPO, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    index = root / "index.jsonl"
    while time.time() < deadline and (not index.exists() or index.read_bytes().count(b"\n") < 5):
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    store = FeatureStore(root)
    assert len(store) >= 5
    for i in range(len(store)):  # every committed sequence reads back whole
        item = store[i]
        assert item["features"].shape == (len(item["input_ids"]), len(LAYERS) * 64)
        assert item["topk_ids"].shape == (len(item["input_ids"]), 8)
    target = tiny_target(vocab_size=64)
    from .test_store import random_records as records_again

    stored = {store[i]["id"] for i in range(len(store))}
    everything = records_again(n=400, seed=1)
    records = [r for r in everything if r["id"] in stored] + [r for r in everything if r["id"] not in stored][:3]
    build_store(target, records, FeatureStore(root, meta_for(target)), tokens_per_shard=1)
    final = FeatureStore(root)
    final_ids = [final[i]["id"] for i in range(len(final))]
    assert sorted(final_ids) == sorted(r["id"] for r in records)  # resumed: the new ones once, nothing twice


def test_sparse_kl_equals_full_kl_when_k_is_the_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 3
    target_logprobs = (torch.randn(3, 5, 11) * 2).log_softmax(-1)
    ids = target_logprobs.argsort(-1, descending=True)  # top-k order, k = V
    sparse = sparse_cross_entropy(logits, ids, target_logprobs.gather(-1, ids), None)
    p = target_logprobs.exp()
    full_ce = -(p * logits.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(sparse, full_ce)
    kl = F.kl_div(logits.log_softmax(-1), target_logprobs, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(sparse - (-(p * target_logprobs).sum(-1)), kl)
    # Through a vocabulary subset holding every id, nothing changes.
    subset = torch.arange(11)
    torch.testing.assert_close(sparse_cross_entropy(logits, ids, target_logprobs.gather(-1, ids), subset), sparse)
    # A truncated top-k renormalises over what it kept (and so differs from the full CE).
    top3 = sparse_cross_entropy(logits, ids[..., :3], target_logprobs.gather(-1, ids[..., :3]), None)
    assert not torch.allclose(top3, full_ce)


def test_auto_precision_follows_the_probe(monkeypatch, tmp_path):
    assert precision.resolve_precision("auto", "cpu", probe=lambda: False) == "no"
    assert precision.resolve_precision("auto", "cpu", probe=lambda: True) == "bf16"
    assert precision.resolve_dtype("auto", "cpu", probe=lambda: False) == torch.float32
    assert precision.resolve_precision("fp32") == "no" and precision.resolve_precision("bf16") == "bf16"
    with pytest.raises(ValueError, match="'fast'"):
        precision.resolve_precision("fast")
    # A CPU whose flags say "no bf16 units" is decided without timing anything.
    monkeypatch.setattr(precision, "_cpu_has_bf16_flags", lambda: False)
    monkeypatch.setattr(precision, "time_matmul_speedup", lambda: pytest.fail("timed a CPU known to be slow"))
    assert precision.resolve_precision("auto", "cpu") == "no"


def test_precision_probe_cache_is_used_and_a_bad_file_is_ignored(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("HF_DFLASH2_CACHE", str(tmp_path))
    monkeypatch.setattr(precision, "_cpu_has_bf16_flags", lambda: None)
    calls = []
    monkeypatch.setattr(precision, "time_matmul_speedup", lambda: calls.append(1) or 3.0)
    assert precision.cpu_bf16_is_fast() and precision.cpu_bf16_is_fast()
    assert len(calls) == 1, "the second call must come from the cache"
    (tmp_path / "precision.json").write_text("{not json")
    with caplog.at_level("WARNING"):
        assert precision.cpu_bf16_is_fast()
    assert "ignoring unreadable precision cache" in caplog.text and len(calls) == 2
    assert json.loads((tmp_path / "precision.json").read_text())  # rewritten whole


def test_decode_precision_has_its_own_probe_and_cache_entry(monkeypatch, tmp_path):
    """A CPU whose bf16 is fast for training-sized products but slow for one-row decode steps (an AMX Xeon was one)
    trains in bf16 and decodes in fp32; each verdict is cached under its own key."""
    monkeypatch.setenv("HF_DFLASH2_CACHE", str(tmp_path))
    monkeypatch.setattr(precision, "_cpu_has_bf16_flags", lambda: None)
    calls = []
    monkeypatch.setattr(precision, "time_matmul_speedup", lambda: calls.append("train") or 3.0)
    monkeypatch.setattr(precision, "time_decode_speedups",
                        lambda config, kernels: calls.append("decode") or [0.63, 2.3])
    assert precision.resolve_precision("auto", "cpu") == "bf16"
    assert precision.resolve_precision("auto", "cpu", workload="decode") == "no"
    assert precision.resolve_dtype("auto", "cpu", workload="decode") == torch.float32
    assert calls == ["train", "decode"], "the second decode verdict must come from the cache"
    entries = json.loads((tmp_path / "precision.json").read_text())
    assert sorted(str(v) for v in entries.values()) == ["{'speedup': 3.0}", "{'speedups': [0.63, 2.3]}"]
    # Each verdict on a fresh cache: bf16 must not be slower at one row and clearly faster at the verify.
    for index, (speedups, verdict) in enumerate([([1.4, 2.3], "bf16"), ([1.05, 1.5], "bf16"), ([1.05, 1.1], "no"),
                                                  ([0.95, 3.0], "no")]):
        monkeypatch.setenv("HF_DFLASH2_CACHE", str(tmp_path / f"other{index}"))
        monkeypatch.setattr(precision, "time_decode_speedups", lambda config, kernels, s=speedups: s)
        assert precision.resolve_precision("auto", "cpu", workload="decode") == verdict, speedups
    with pytest.raises(ValueError, match="'serve'"):
        precision.resolve_precision("auto", "cpu", workload="serve")


def test_demo_and_bench_load_the_target_in_the_decode_verdicts_dtype(monkeypatch, tmp_path):
    """``auto`` for decoding probes with the loaded target's own shapes, then casts (or not)."""
    import hf_dflash2.assets

    from .conftest import tiny_target

    monkeypatch.setenv("HF_DFLASH2_CACHE", str(tmp_path))
    monkeypatch.setattr(precision, "_cpu_has_bf16_flags", lambda: None)
    monkeypatch.setattr(hf_dflash2.assets, "load_target", lambda *a, dtype=None: (tiny_target().to(dtype), None))
    seen, kernels_seen = [], []
    verdicts = iter([[0.63, 2.3], [1.4, 2.3], [1.4, 2.3]])
    monkeypatch.setattr(precision, "time_decode_speedups",
                        lambda config, kernels: seen.append(config) or kernels_seen.append(kernels) or next(verdicts))
    target, _ = precision.load_target_for_decoding("auto")
    assert target.dtype == torch.float32
    assert precision.decoder_matrices(seen[0])[(64, 96)] == 1  # the tiny target's LM head, not SmolLM2's
    monkeypatch.setenv("HF_DFLASH2_CACHE", str(tmp_path / "other"))
    assert precision.load_target_for_decoding("auto")[0].dtype == torch.bfloat16
    assert precision.load_target_for_decoding("fp32")[0].dtype == torch.float32 and len(seen) == 2
    # The probe times each dtype on the kernels the caller allows (and caches each choice on its own).
    assert precision.load_target_for_decoding("auto", linear_kernel="default")[0].dtype == torch.bfloat16
    assert kernels_seen[0] == linear_kernels.decode_probe_kernels("auto") and kernels_seen[2] == ("default",)
    assert len(seen) == 3


def test_decode_probe_times_both_row_counts():
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "vocab_size": 100}
    speedups = precision.time_decode_speedups(type("Config", (), tiny)(), repeats=1)
    assert len(speedups) == len(precision.DECODE_ROWS) and all(s > 0 for s in speedups)
    assert precision.DECODE_ROWS == (1, 16)


def test_decode_probe_takes_each_dtypes_faster_kernel(monkeypatch):
    """Each dtype is timed on the allowed kernels and counts on its faster one (oneDNN only when
    ``ONEDNN_MIN_SPEEDUP`` faster, as ``use_linear_kernel`` decides); a dtype oneDNN cannot pack keeps the
    default, and with oneDNN alone allowed it can never be chosen."""
    tiny = type("Config", (), {"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "vocab_size": 8})()
    # Fake kernels with known costs: the clock advances by a per-(dtype, kernel, rows) amount per call.
    costs = {(torch.float32, "default"): 4.0, (torch.float32, "onednn"): 3.0,
             (torch.bfloat16, "default"): 8.0, (torch.bfloat16, "onednn"): 1.0}
    now = [0.0]
    monkeypatch.setattr(precision.time, "perf_counter", lambda: now[0])

    def kernel(dtype, name):
        def run(x):
            now[0] += costs[dtype, name] * (1 + x.shape[0] / 16)
        return run
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w: kernel(w.dtype, "default")(x))
    monkeypatch.setattr(linear_kernels, "onednn_linear", lambda w: kernel(w.dtype, "onednn"))
    both = precision.time_decode_speedups(tiny, repeats=1, kernels=("default", "onednn"))
    assert both == pytest.approx([3.0, 3.0])  # fp32 on oneDNN (3) over bf16 on oneDNN (1)
    assert precision.time_decode_speedups(tiny, repeats=1, kernels=("default",)) == pytest.approx([0.5, 0.5])
    # oneDNN only 1.05x faster for fp32: the default kernel stays, as use_linear_kernel would keep it.
    costs[torch.float32, "onednn"] = 4.0 / 1.05
    assert precision.time_decode_speedups(tiny, repeats=1, kernels=("default", "onednn")) == pytest.approx([4, 4])

    def cannot_pack(w):
        if w.dtype == torch.bfloat16:
            raise RuntimeError("bf16 packing needs AVX-512")
        return kernel(w.dtype, "onednn")
    monkeypatch.setattr(linear_kernels, "onednn_linear", cannot_pack)
    assert precision.time_decode_speedups(tiny, repeats=1, kernels=("default", "onednn")) == pytest.approx([.5, .5])
    assert precision.time_decode_speedups(tiny, repeats=1, kernels=("onednn",)) == [0.0, 0.0]


@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps one process-wide state: the other tests' fp32 trainers and this bf16 one must not meet."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("label_source", ["argmax", "kl"])
def test_bf16_training_from_a_store_lowers_the_loss(tmp_path, label_source, fresh_accelerator_state):
    from .test_training import toy_sequences

    target = tiny_target(vocab_size=64)
    with torch.no_grad():
        target.lm_head.weight.mul_(25.0)
    records = [{"id": str(i), **s} for i, s in enumerate(toy_sequences())]
    store = build_store(target, records, FeatureStore(tmp_path / "s", meta_for(target, top_k=8)))
    drafter = tiny_drafter(target, block_size=4, randomize=False, target_layer_ids=LAYERS)
    config = TrainingConfig(
        output_dir=str(tmp_path / "run"),
        steps=40,
        batch_size=2,
        anchors_per_sequence=6,
        checkpoint_every=100,
        learning_rate=5e-3,
        mixed_precision="bf16",
        label_source=label_source,
    )
    trainer = Trainer(target, drafter, store_sequences(store, 512), config, store=store)
    history = trainer.train()
    first, last = sum(h["loss"] for h in history[:5]) / 5, sum(h["loss"] for h in history[-5:]) / 5
    assert first - last > 0.6, (first, last)  # no learning: a difference of ~0
    with pytest.raises(ValueError, match="needs a feature store"):
        Trainer(target, drafter, records, TrainingConfig(output_dir=str(tmp_path / "x"), label_source="kl"))


def store_trainer(tmp_path, target_layer_ids):
    """A one-step trainer over a store of three random records, for a head tapping ``target_layer_ids``."""
    target = tiny_target(vocab_size=64)
    records = random_records(n=3)
    store = build_store(target, records, FeatureStore(tmp_path / "s", meta_for(target)))
    drafter = tiny_drafter(target, block_size=4, randomize=False, target_layer_ids=target_layer_ids)
    config = TrainingConfig(output_dir=str(tmp_path / "run"), steps=1, batch_size=1)
    return Trainer(target, drafter, store_sequences(store, 512), config, store=store), records


def test_a_head_tapping_some_of_the_stores_layers_reads_their_columns(tmp_path):
    """One store serves heads that tap a subset of its layers, in the head's own order: the features a
    trainer reads equal the target's own states at those layers. A layer the store lacks is refused by name."""
    trainer, records = store_trainer(tmp_path, [4, 1])
    target, store, config = trainer.target, trainer.store, trainer.config
    for index, sequence in enumerate(trainer.sequences):
        record = records[sequence["store_index"]]
        with torch.no_grad():
            states = target(input_ids=torch.tensor([record["input_ids"]]), output_hidden_states=True).hidden_states
        expected = tapped_features(states, [4, 1]).to(torch.bfloat16).float()
        assert torch.allclose(trainer.sequence_item(index)["features"].float(), expected, rtol=1e-2, atol=1e-2)
    outside = tiny_drafter(target, block_size=4, randomize=False, target_layer_ids=[1, 2])
    with pytest.raises(ValueError, match=re.escape("the store keeps only [1, 3, 4] (not [2])")):
        Trainer(target, outside, store_sequences(store, 512), config, store=store)


def test_a_store_run_starts_its_context_from_the_target(tmp_path):
    """``--init-context-from-target`` on a store run reads its calibration text from the store, and fc in
    its standardized space passes on exactly what the first copied layer reads."""
    trainer, records = store_trainer(tmp_path, [1, 3])
    target, drafter = trainer.target, trainer.accelerator.unwrap_model(trainer.drafter)
    trainer.initialize_layers_from_target("last", context=True)
    assert trainer.initialized_from["target_context"] == 4 and "4" in trainer.initialized_from["query_key_scales"]
    record = records[trainer.sequences[0]["store_index"]]
    with torch.no_grad():
        states = target(input_ids=torch.tensor([record["input_ids"]]), output_hidden_states=True).hidden_states
        expected = target.get_decoder().layers[4].input_layernorm(states[4])
        context = drafter.project_context(trainer.sequence_item(0)["features"].float() / trainer.feature_scale)
    torch.testing.assert_close(context, expected, rtol=2e-2, atol=2e-2)  # the store keeps bf16 features
    trainer.train()


def test_final_hidden_states_are_what_the_lm_head_reads_and_line_up_with_the_labels(tmp_path):
    from hf_dflash2.training.blocks import final_hidden_for_blocks, target_labels_for_blocks

    target = tiny_target(vocab_size=64)
    records = random_records(n=5)
    meta = meta_for(target, final_hidden=True)
    build_store(target, records, FeatureStore(tmp_path / "s", meta), tokens_per_batch=96, tokens_per_shard=50)
    store = FeatureStore(tmp_path / "s")
    by_id = {store[i]["id"]: store[i] for i in range(len(store))}
    for record in records:
        item = by_id[record["id"]]
        with torch.no_grad():
            out = target(input_ids=torch.tensor([record["input_ids"]]), output_hidden_states=True)
        # hidden_states[-1] is after the final norm here: exactly the LM head's input
        torch.testing.assert_close(item["final_hidden"].float(), out.hidden_states[-1][0].bfloat16().float())
        # the block targets sit where the target predicts each block's argmax label (a + k - 1)
        anchors = torch.tensor([0, 3, len(record["input_ids"]) - 3])
        labels, _, _ = target_labels_for_blocks(item, anchors, 4, "argmax")
        goal = final_hidden_for_blocks(item, anchors, 4)
        with torch.no_grad():
            predicted = target.lm_head(goal.float()).argmax(-1)
        inside = labels >= 0
        assert inside.sum() >= 7 and (predicted == labels)[inside].float().mean() >= 0.9
        # ...and the first token after anchor a is the one the target predicts at a itself
        assert torch.equal(labels[:, 0], out.logits[0, anchors].argmax(-1))
    # a store is one kind or the other: reopening it with the other meta, or a shard without the array, is refused
    with pytest.raises(ValueError, match="final_hidden=True"):
        FeatureStore(tmp_path / "s", meta_for(target))
    plain = FeatureStore(tmp_path / "plain", meta_for(target))
    with pytest.raises(ValueError, match="final_hidden=False, but the shard has"):
        plain.append(records[:1], torch.zeros(len(records[0]["input_ids"]), meta.feature_width),
                     torch.zeros(len(records[0]["input_ids"]), 8), torch.zeros(len(records[0]["input_ids"]), 8),
                     torch.zeros(len(records[0]["input_ids"]), meta.hidden_size))
    assert "final_hidden" not in build_store(target, records[:1], plain)[0]


def test_the_hidden_loss_is_the_position_decayed_relative_error():
    from hf_dflash2.training.losses import block_loss, position_weights

    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=4)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 3, target.config.hidden_size, generator=generator)
    goal = torch.randn(5, 3, target.config.hidden_size, generator=generator) * 2
    labels = torch.randint(2, 64, (5, 3), generator=generator)
    labels[0, 2] = -100
    predecessors = torch.randint(2, 64, (5, 3), generator=generator)
    base, _ = block_loss(drafter, hidden, labels, predecessors, 2.0)
    with_hidden, metrics = block_loss(
        drafter, hidden, labels, predecessors, 2.0, hidden_targets=goal, hidden_weight=3.0
    )
    weights = position_weights(3, 2.0)[None].expand(5, 3) * (labels >= 0)
    relative = ((hidden - goal) ** 2).mean(-1) / (goal**2).mean(-1)
    expected = float((relative * weights).sum() / weights.sum())
    assert metrics["hidden_loss"] == pytest.approx(expected, rel=1e-5)
    assert float((with_hidden - base).detach()) == pytest.approx(3.0 * expected, rel=1e-4)
    _, exact = block_loss(drafter, goal, labels, predecessors, 2.0, hidden_targets=goal, hidden_weight=1.0)
    assert exact["hidden_loss"] == pytest.approx(0.0, abs=1e-7)


def test_hidden_distillation_trains_and_needs_a_store_with_final_states(tmp_path, fresh_accelerator_state):
    from .test_training import toy_sequences

    target = tiny_target(vocab_size=64)
    records = [{"id": str(i), **s} for i, s in enumerate(toy_sequences())]
    meta = meta_for(target, final_hidden=True)
    store = build_store(target, records, FeatureStore(tmp_path / "s", meta))
    drafter = tiny_drafter(target, block_size=4, randomize=False, target_layer_ids=LAYERS)
    config = TrainingConfig(output_dir=str(tmp_path / "run"), steps=40, batch_size=2, anchors_per_sequence=6,
                            checkpoint_every=100, learning_rate=5e-3, label_source="argmax", hidden_weight=1.0)
    history = Trainer(target, drafter, store_sequences(store, 512), config, store=store).train()
    first = sum(h["hidden_loss"] for h in history[:5]) / 5
    last = sum(h["hidden_loss"] for h in history[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    plain = build_store(target, records, FeatureStore(tmp_path / "plain", meta_for(target)))
    with pytest.raises(ValueError, match="hidden_weight=1.0 needs a feature store built with final hidden"):
        Trainer(target, drafter, store_sequences(plain, 512), config, store=plain)
    with pytest.raises(ValueError, match=r"hidden_weight must be a finite number >= 0 \(0: off\), got -1.0"):
        TrainingConfig(hidden_weight=-1.0).validate()


def test_train_refuses_a_run_folder_shape_options_and_a_store_of_another_target_before_loading(tmp_path, monkeypatch):
    target = tiny_target(vocab_size=64)
    build_store(target, random_records(n=3), FeatureStore(tmp_path / "s", meta_for(target)), tokens_per_batch=48)
    from hf_dflash2 import assets
    from hf_dflash2.cli import main

    def no_target(*args, **kwargs):
        raise AssertionError("the target must not load before the arguments are checked")

    monkeypatch.setattr(assets, "load_target", no_target)
    train = ["train", "--store", str(tmp_path / "s"), "--mixed-precision", "fp32"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"a run")
    with pytest.raises(SystemExit, match="already holds a run .*pass --resume"):
        main([*train, "--output", str(tmp_path / "run")])
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == b"a run"  # untouched
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit, match="--output .*afile is a file"):
        main([*train, "--output", str(tmp_path / "afile")])
    for option, value, message in (("--layers", "0", "--layers must be >= 1, got 0"),
                                   ("--block-size", "1", "--block-size must be >= 2, got 1"),
                                   ("--log-every", "0", "log_every must be >= 1, got 0"),
                                   ("--lr", "inf", "learning_rate must be a finite number > 0, got inf"),
                                   ("--draft-vocab-size", "0", "draft_vocab_size must be >= 1")):
        with pytest.raises(SystemExit, match=re.escape(message)):
            main([*train, "--output", str(tmp_path / "new"), option, value])
    with pytest.raises(SystemExit, match="holds the features of 'tiny', not of 'other/lm'"):
        main([*train, "--output", str(tmp_path / "new"), "--target", "other/lm"])
    assert not (tmp_path / "new").exists()


def test_store_refuses_a_folder_that_is_not_a_store_and_bad_sizes_before_loading(tmp_path, monkeypatch):
    from hf_dflash2 import assets
    from hf_dflash2.cli import main

    def no_target(*args, **kwargs):
        raise AssertionError("the target must not load before the arguments are checked")

    monkeypatch.setattr(assets, "load_target", no_target)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    store = ["store", "--mixed-precision", "fp32"]
    with pytest.raises(SystemExit, match="exists and is not a feature store"):
        main([*store, "--output", str(tmp_path / "model")])
    assert [p.name for p in (tmp_path / "model").iterdir()] == ["config.json"]
    for option in ("--top-k", "--max-length", "--max-tokens"):
        with pytest.raises(SystemExit, match=f"{option} must be >= 1, got 0"):
            main([*store, "--output", str(tmp_path / "new"), option, "0"])


def test_store_checks_layers_and_top_k_against_the_target_before_writing_meta(tmp_path, monkeypatch):
    from hf_dflash2.cli import main
    from hf_dflash2.training import commands

    target = tiny_target(vocab_size=64)
    monkeypatch.setattr(commands, "_load_target", lambda args, precision: (target, None, torch.float32))
    store = ["store", "--mixed-precision", "fp32", "--output", str(tmp_path / "s")]
    with pytest.raises(SystemExit, match=r"--target-layer-ids \[1, 2, 9\]: the target has layers 0..5"):
        main([*store, "--target-layer-ids", "1,2,9"])
    with pytest.raises(SystemExit, match="--top-k 500 exceeds the target's vocabulary of 64"):
        main([*store, "--top-k", "500"])
    assert not (tmp_path / "s" / "meta.json").exists()  # a corrected rerun is not locked out
