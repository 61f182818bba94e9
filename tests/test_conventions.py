"""Transformers conventions: plain save_pretrained heads, custom_generate, the hook's signature check."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

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
    for name in ("configuration_dflash2.py", "modeling_dflash2.py", "candidate_generator_dflash2.py",
                 "speculative_dflash2.py", "custom_generate_dflash2.py"):
        assert name in names, name
    assert (tmp_path / "head" / "custom_generate" / "generate.py").is_file()


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
    from hf_dflash2.candidate_generator_dflash2 import SUPPORTED_TRANSFORMERS, check_hooked_signature
    from transformers.generation.utils import GenerationMixin

    check_hooked_signature(getattr(GenerationMixin._get_candidate_generator, "__wrapped__",
                                   GenerationMixin._get_candidate_generator))

    def changed(self, generation_config, inputs_tensor, input_ids, logits_processor, model_kwargs, assistant_model=None):
        pass

    with pytest.raises(ImportError, match="inputs_tensor") as error:
        check_hooked_signature(changed)
    assert SUPPORTED_TRANSFORMERS in str(error.value)


def test_repository_heads_hold_no_code_and_load_with_the_package():
    from hf_dflash2 import DFlash2DraftModel

    from .conftest import REPO

    for head in sorted((REPO / "heads").iterdir()):
        assert not list(head.rglob("*.py")), f"{head} holds a copy of the code"
        drafter = DFlash2DraftModel.from_pretrained(head)
        assert drafter.config.num_target_layers == 30 and drafter.draft_vocab is not None


def test_push_writes_the_code_of_a_head_kept_without_it(tmp_path, hub):
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
    for name in ("configuration_dflash2.py", "candidate_generator_dflash2.py", "speculative_dflash2.py"):
        assert name in files, name
    assert json.loads(files["config.json"])["auto_map"]["AutoModel"] == "modeling_dflash2.DFlash2DraftModel"
    assert {p.name: p.read_bytes() for p in head.iterdir() if p.is_file()} == before  # the folder is untouched
