"""Checkpoint format: published tensor names, config fields, round trips, remote code."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch
from safetensors import safe_open

from hf_dflash2 import DFlash2Config, DFlash2DraftModel
from hf_dflash2.hub import save_head

from .conftest import FIXTURES, tiny_drafter, tiny_target


def test_published_config_builds_exact_tensor_names_and_shapes():
    config = DFlash2Config(**json.loads((FIXTURES / "dflash2-config.json").read_text()))
    with torch.device("meta"):
        model = DFlash2DraftModel(config)
    header = json.loads((FIXTURES / "dflash2-safetensors-header.json").read_text())
    header.pop("__metadata__", None)
    expected = {name: list(info["shape"]) for name, info in header.items()}
    actual = {name: list(t.shape) for name, t in model.state_dict().items()}
    assert sorted(actual) == sorted(expected)
    assert actual == expected
    assert config.use_conv and config.use_selector and config.block_size == 16
    assert [layer.is_sliding for layer in model.layers] == [True] * 5


def test_save_writes_published_config_fields_and_safetensors(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    save_head(drafter, tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["is_causal"] is False
    assert config["vocab_size"] == 96 and config["num_target_layers"] == 6
    assert config["dflash_config"]["block_size"] == 4
    assert config["dflash_config"]["selector_rank"] == 16
    assert config["auto_map"]["AutoModel"] == "modeling_dflash2.DFlash2DraftModel"
    assert not list((tmp_path / "head").glob("*.bin"))
    with safe_open(tmp_path / "head" / "model.safetensors", "pt") as handle:
        names = set(handle.keys())
    assert names == set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_round_trip_bit_exact_and_dtype_preserved(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target).to(torch.bfloat16)
    drafter.save_pretrained(tmp_path / "bf16")
    loaded = DFlash2DraftModel.from_pretrained(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_dflash1_head_uses_published_architecture_name_and_loads(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target, dflash2=False)
    save_head(drafter, tmp_path / "v1")
    config = json.loads((tmp_path / "v1" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert "selector_rank" not in config["dflash_config"]
    loaded = DFlash2DraftModel.from_pretrained(tmp_path / "v1")
    assert loaded.candidate_selector is None and loaded.layers[0].attention_conv is None


def test_published_folder_without_auto_map_loads(tmp_path):
    """z-lab / incoai heads carry no auto_map; DFlash2DraftModel.from_pretrained still reads them."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config.pop("auto_map", None)
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    loaded = DFlash2DraftModel.from_pretrained(tmp_path / "plain")
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_remote_code_loads_without_the_package_bit_exact(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    save_head(drafter, tmp_path / "head")
    target.save_pretrained(tmp_path / "target")
    ids = torch.tensor([[5, 9, 17, 3, 44, 21, 8]])
    expected = drafter.bind_target(target)
    from hf_dflash2.generation import speculative_generate

    reference = speculative_generate(target, drafter, ids, max_new_tokens=12)
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    torch.save({"ids": ids, "state": {k: v for k, v in drafter.state_dict().items()}, "plain": plain}, tmp_path / "ref.pt")
    script = textwrap.dedent(
        f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "hf_dflash2" or name.startswith("hf_dflash2."):
                    raise ImportError("hf_dflash2 is blocked in this process")
        sys.meta_path.insert(0, Block())
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        ref = torch.load({str(tmp_path / 'ref.pt')!r})
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'target')!r}).eval()
        drafter = AutoModel.from_pretrained({str(tmp_path / 'head')!r}, trust_remote_code=True).eval()
        assert "hf_dflash2" not in sys.modules
        assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
        for name, tensor in drafter.state_dict().items():
            assert torch.equal(tensor, ref["state"][name]), name
        drafter.bind_target(target)
        out = target.generate(ref["ids"], max_new_tokens=12, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, ref["plain"]), (out, ref["plain"])
        print("STATS", drafter.last_speculative_stats.rounds)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STATS" in result.stdout
    assert expected is drafter and reference.sequences.shape[1] == ids.shape[1] + 12


def test_remote_code_drafter_hidden_states_bit_exact(tmp_path):
    """The remote-code class computes exactly the package class's draft hidden states."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    save_head(drafter, tmp_path / "head")
    torch.manual_seed(0)
    features = torch.randn(2, 9, 64 * len(drafter.config.target_layer_ids))
    torch.save({"features": features}, tmp_path / "in.pt")

    def draft_hidden(model):
        model.bind_target(target)
        positions = torch.arange(9)[None].expand(2, -1)
        kv = model.context_kv(model.project_context(features), positions)
        out = model.draft_block(torch.tensor([3, 7]), torch.tensor([9, 9]), kv, torch.ones(2, 9, dtype=torch.bool), positions)
        return out.hidden, out.tokens

    expected_hidden, expected_tokens = draft_hidden(drafter)
    torch.save({"hidden": expected_hidden, "tokens": expected_tokens, "features": features}, tmp_path / "in.pt")
    target.save_pretrained(tmp_path / "target")
    script = textwrap.dedent(
        f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] == "hf_dflash2":
                    raise ImportError("blocked")
        sys.meta_path.insert(0, Block())
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        ref = torch.load({str(tmp_path / 'in.pt')!r})
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'target')!r}).eval()
        model = AutoModel.from_pretrained({str(tmp_path / 'head')!r}, trust_remote_code=True).eval().bind_target(target)
        positions = torch.arange(9)[None].expand(2, -1)
        with torch.no_grad():
            kv = model.context_kv(model.project_context(ref["features"]), positions)
            out = model.draft_block(torch.tensor([3, 7]), torch.tensor([9, 9]), kv, torch.ones(2, 9, dtype=torch.bool), positions)
        assert torch.equal(out.hidden, ref["hidden"]), (out.hidden - ref["hidden"]).abs().max()
        assert torch.equal(out.tokens, ref["tokens"])
        print("OK")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
