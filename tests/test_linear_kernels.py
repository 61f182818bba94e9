"""CPU linear kernels: oneDNN with packed weights, its fallbacks, `auto`, and the cost-model key."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from hf_dflash2 import cost_model_dflash2 as cm
from hf_dflash2 import kernels_dflash2 as kd
from hf_dflash2 import speculative_generate
from hf_dflash2.cpu import linear_kernels as lk
from hf_dflash2.settings import BenchSettings, DemoSettings

from .conftest import tiny_drafter, tiny_target

pytestmark = pytest.mark.skipif(not lk.onednn_available(), reason="this torch build has no oneDNN")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DFLASH2_CACHE", str(tmp_path / "cache"))


def _packed_forwards(model) -> int:
    return sum(isinstance(m.__dict__.get("forward"), lk.PackedLinearForward) for m in model.modules())


def test_packed_model_matches_the_default_and_stays_lossless():
    target = tiny_target(vocab_size=96, layers=3)
    drafter = tiny_drafter(target, block_size=4)
    ids = torch.randint(2, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = target(ids).logits
        expected = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    state = {k: v.clone() for k, v in target.state_dict().items()}
    linears = sum(isinstance(m, torch.nn.Linear) for m in target.modules())

    assert lk.use_linear_kernel(target, "onednn") == "onednn" and lk.use_linear_kernel(drafter, "onednn") == "onednn"
    assert _packed_forwards(target) == linears and cm.linear_kernel_of(target) == "onednn"
    with torch.no_grad():
        packed = target(ids).logits
        sped = speculative_generate(target, drafter, ids, max_new_tokens=20)
        plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    torch.testing.assert_close(packed, reference, atol=1e-4, rtol=1e-4)
    assert torch.equal(sped.sequences, plain) and torch.equal(plain, expected)
    # parameters and what save_pretrained writes are untouched
    assert target.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in target.state_dict().items())

    assert lk.use_linear_kernel(target, "default") == "default"
    assert _packed_forwards(target) == 0 and cm.linear_kernel_of(target) == "default"


def test_a_packed_layer_falls_back_whenever_the_packed_copy_could_be_wrong():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    lk.pack_linears(layer)
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.weight.mul_(-2.0)  # written in place after packing: the packed copy is stale
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.weight.requires_grad_(True)
    layer(x).sum().backward()  # gradients wanted: the autograd path
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    lk.pack_linears(layer)
    layer.double()  # moved to another dtype: the fp32 pack no longer applies
    with torch.no_grad():
        torch.testing.assert_close(layer(x.double()), F.linear(x.double(), layer.weight, layer.bias))


def test_packing_leaves_someone_elses_forward_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    hooked = model[0]
    original = hooked.forward
    hooked.forward = lambda x: original(x) * 0  # e.g. accelerate's offload hook
    assert lk.pack_linears(model) == 1
    assert not isinstance(hooked.__dict__["forward"], lk.PackedLinearForward)
    assert torch.equal(model[0](torch.ones(1, 4)), torch.zeros(1, 4))

    class Halved(torch.nn.Linear):  # a layer subclass with a forward of its own (a quantised layer, say)
        def forward(self, x):
            return super().forward(x) / 2

    model = torch.nn.Sequential(Halved(4, 4), torch.nn.Linear(4, 4))
    expected = model[0](torch.ones(1, 4))
    assert lk.pack_linears(model) == 1 and "forward" not in model[0].__dict__
    assert torch.equal(model[0](torch.ones(1, 4)), expected)


def test_auto_packs_only_when_the_probe_says_onednn_is_clearly_faster(caplog):
    target = tiny_target(layers=2)
    with caplog.at_level(logging.INFO, logger="hf_dflash2.cpu.linear_kernels"):
        assert lk.use_linear_kernel(target, "auto", probe=lambda model: 1.5) == "onednn"
    assert _packed_forwards(target) > 0 and "oneDNN 1.50x" in caplog.text
    assert lk.use_linear_kernel(target, "auto", probe=lambda model: 1.05) == "default"  # within noise: unpacked
    assert _packed_forwards(target) == 0
    with pytest.raises(ValueError, match="'fast'"):
        lk.use_linear_kernel(target, "fast")
    for settings in (BenchSettings, DemoSettings):
        with pytest.raises(ValueError, match="linear_kernel must be one of .* got 'mkl'"):
            settings(linear_kernel="mkl")


def test_the_probe_is_cached_per_machine_and_a_bad_cache_is_ignored(monkeypatch, caplog):
    target = tiny_target(layers=2)
    calls = []
    monkeypatch.setattr(kd, "time_onednn_speedup", lambda model, rows: calls.append(rows) or 1.7)
    assert lk.onednn_speedup(target) == 1.7 and lk.onednn_speedup(target) == 1.7 and len(calls) == 1
    path = cm.cost_cache_dir() / "linear_kernel.json"
    assert list(json.loads(path.read_text()).values()) == [{"speedup": 1.7}]
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert lk.onednn_speedup(target) == 1.7
    assert len(calls) == 2 and "ignoring unreadable linear-kernel cache" in caplog.text
    assert json.loads(path.read_text())  # rewritten whole
    # Another workload's rows (regeneration's batch) is probed and cached under its own key.
    assert lk.onednn_speedup(target, rows=(64,)) == 1.7 and lk.onednn_speedup(target, rows=(64,)) == 1.7
    assert calls == [lk.PROBE_ROWS, lk.PROBE_ROWS, (64,)] and len(json.loads(path.read_text())) == 2


def test_the_real_probe_times_both_kernels_and_leaves_the_model_unpacked():
    target = tiny_target(layers=2)
    speedup = lk.time_onednn_speedup(target, repeats=1)
    assert speedup > 0 and _packed_forwards(target) == 0


def test_cost_models_are_kept_apart_per_kernel():
    target = tiny_target(vocab_size=64, layers=2)
    drafter = tiny_drafter(target, block_size=4)
    before = cm.cost_key(target, drafter, 1, 4, 32)
    lk.use_linear_kernel(target, "onednn")
    lk.use_linear_kernel(drafter, "onednn")
    after = cm.cost_key(target, drafter, 1, 4, 32)
    assert before["linear_kernel"] == "default/default" and after["linear_kernel"] == "onednn/onednn"
    measured = cm.load_or_measure_cost_model(target, drafter, 1, 4, context_length=32)
    assert measured.key["linear_kernel"] == "onednn/onednn"
    lk.use_linear_kernel(target, "default")
    lk.use_linear_kernel(drafter, "default")
    assert cm.load_or_measure_cost_model(target, drafter, 1, 4, context_length=32) is not measured


def test_a_head_loaded_for_a_packed_target_follows_its_kernel(tmp_path):
    from hf_dflash2.prompts import load_head

    target = tiny_target(vocab_size=64, layers=2)
    tiny_drafter(target, block_size=4).save_pretrained(tmp_path / "head")
    assert cm.linear_kernel_of(load_head(tmp_path / "head", target)) == "default"
    lk.use_linear_kernel(target, "onednn")
    assert cm.linear_kernel_of(load_head(tmp_path / "head", target)) == "onednn"


def test_a_cpu_that_cannot_pack_keeps_the_default_kernel(monkeypatch):
    """bf16 packing needs AVX-512 or AVX-NE-CONVERT: `auto` then stays on the default, `onednn` says why."""
    def refuse(self, module, rows_hint=16):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(lk.PackedLinearForward, "__init__", refuse)
    target = tiny_target(layers=2)
    assert lk.time_onednn_speedup(target) == 0.0
    assert lk.use_linear_kernel(target, "auto") == "default" and _packed_forwards(target) == 0
    with pytest.raises(ValueError, match="cannot pack torch.float32 linear weights on this CPU"):
        lk.use_linear_kernel(target, "onednn")
    assert _packed_forwards(target) == 0


def test_a_model_built_under_inference_mode_packs_too():
    with torch.inference_mode():
        layer = torch.nn.Linear(8, 4)
        lk.pack_linears(layer)
        x = torch.randn(2, 8)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_deep_copy_of_a_packed_model_reads_its_own_weights():
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    lk.pack_linears(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.copy_(torch.randn(8, 8))  # the copy diverges; the original's packed copy must not leak
        x = torch.randn(3, 8)
        torch.testing.assert_close(twin(x), F.linear(F.linear(x, twin[0].weight, twin[0].bias),
                                                     twin[1].weight, twin[1].bias))
        torch.testing.assert_close(model(x), F.linear(F.linear(x, model[0].weight, model[0].bias),
                                                      model[1].weight, model[1].bias))


def test_a_full_vocabulary_draft_runs_through_the_targets_packed_lm_head():
    """A head without a draft vocabulary multiplies by the target's whole LM head every draft pass; it calls
    the target's module, so that the packed kernel serves it (training, with gradients, keeps F.linear)."""
    target = tiny_target(vocab_size=96, layers=3)
    drafter = tiny_drafter(target, block_size=4)
    assert drafter.draft_vocab is None
    hidden = torch.randn(2, 3, target.config.hidden_size)
    with torch.no_grad():
        reference, _ = drafter.unary_logits(hidden)
    lk.use_linear_kernel(target, "onednn")
    packed = target.get_output_embeddings().__dict__["forward"]
    calls = []
    spy = lambda x: calls.append(x.shape) or packed(x)  # noqa: E731
    target.get_output_embeddings().forward = spy
    drafter.bind_target(target)
    with torch.no_grad():
        logits, vocab = drafter.unary_logits(hidden)
    assert vocab is None and calls == [torch.Size([6, target.config.hidden_size])]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    drafter.unary_logits(hidden.requires_grad_())
    assert len(calls) == 1
    drafter.set_draft_vocab(list(range(0, 96, 2)))
    with torch.no_grad():
        logits, vocab = drafter.unary_logits(hidden)
    assert len(calls) == 1 and logits.shape[-1] == 48  # a draft vocabulary's rows are their own matrix


def test_a_draft_vocabulary_runs_on_the_kernel_of_the_targets_lm_head(monkeypatch):
    """The draft vocabulary's rows are their own matrix; while the target's LM head is packed on oneDNN they
    are packed too (the draft pass's largest matmul at batch > 1), once; on the default kernel, and with
    gradients, they stay on F.linear; switching the target's kernel back and forth repacks nothing; a target
    weight written in place is gathered again. Same logits either way."""
    target = tiny_target(vocab_size=96, layers=3)
    drafter = tiny_drafter(target, block_size=4)
    drafter.set_draft_vocab(list(range(0, 96, 2)))
    hidden = torch.randn(2, 3, target.config.hidden_size)
    calls, packs = [], []
    mkldnn = torch.ops.mkldnn
    pointwise, reorder = mkldnn._linear_pointwise, mkldnn._reorder_linear_weight

    class Spy:
        def __getattr__(self, name):
            return getattr(mkldnn, name)

        def _linear_pointwise(self, x, *args):
            calls.append(tuple(x.shape))
            return pointwise(x, *args)

        def _reorder_linear_weight(self, weight, *args):
            packs.append(tuple(weight.shape))
            return reorder(weight, *args)

    monkeypatch.setattr(torch.ops, "mkldnn", Spy())
    with torch.no_grad():
        reference, vocab = drafter.unary_logits(hidden)
        assert calls == [] and vocab.tolist() == list(range(0, 96, 2))
        lk.use_linear_kernel(target, "onednn")
        calls.clear(), packs.clear()
        packed, _ = drafter.unary_logits(hidden)
        drafter.unary_logits(hidden)
        assert calls == [(6, target.config.hidden_size)] * 2 and packs == [(48, target.config.hidden_size)]
        torch.testing.assert_close(packed, reference, atol=1e-4, rtol=1e-4)
        lk.use_linear_kernel(target, "default")
        calls.clear()
        again, _ = drafter.unary_logits(hidden)
        assert calls == [] and torch.equal(again, reference)
        lk.use_linear_kernel(target, "onednn")  # back on oneDNN: the rows' packed copy is reused
        calls.clear(), packs.clear()
        drafter.unary_logits(hidden)
        assert packs == [] and calls == [(6, target.config.hidden_size)]
        target.lm_head.weight.mul_(2.0)  # written in place: the rows are gathered and packed again
        doubled, _ = drafter.unary_logits(hidden)
        assert packs == [(48, target.config.hidden_size)]
        torch.testing.assert_close(doubled, 2 * reference, atol=1e-4, rtol=1e-4)
    lk.use_linear_kernel(target, "onednn")
    calls.clear()
    drafter.unary_logits(hidden.requires_grad_())  # training: gradients flow through F.linear
    assert calls == []
