"""``hf-dflash2 push`` against a local, in-memory Hub stand-in (tests/hub_server.py): no network needed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from hf_dflash2.cli import main
from hf_dflash2.hub import push_head, render_model_card, save_head
from tests.conftest import REPO, tiny_drafter, tiny_target
from tests.hub_server import HubStandIn

TOKEN = "hf_test_token_123"
REPO_ID = "someone/tiny-dflash2"
BASE_MODEL = "someone/tiny-llama"
RESULTS = {
    "datasets": {
        "humaneval": {"tau": 2.14, "per_position_acceptance": [0.8, 0.55, 0.31], "speedup": 1.31},
        "gsm8k": {"tau": 1.9, "per_position_acceptance": [0.7, 0.4, 0.2], "speedup": 1.2},
    },
    "command": "hf-dflash2 bench --head runs/head --datasets humaneval,gsm8k",
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny target (saved) and its head folder, with a base model and a training recipe."""
    root = tmp_path_factory.mktemp("built")
    target = tiny_target()
    head = save_head(tiny_drafter(target), root / "head")
    config = json.loads((head / "config.json").read_text())
    config["base_model"] = BASE_MODEL
    (head / "config.json").write_text(json.dumps(config, indent=2))
    (head / "training_recipe.json").write_text(json.dumps({"steps": 1000, "lr": 6e-4, "block_size": 4}))
    target.save_pretrained(root / "target")
    return root


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def push_temp_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("hf-dflash2-push-*")}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The stand-in, with a fresh HF home, HF_ENDPOINT at the stand-in and a dummy token in HF_TOKEN."""
    server = HubStandIn()
    home = tmp_path / "hf_home"
    home.mkdir()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_XET_CACHE", str(home / "xet"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    # huggingface_hub reads these once, at import: point this process's copies at the fresh home too.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    yield server
    server.stop()


def test_push_then_load_from_the_hub_and_generate(built, hub, tmp_path, capsys):
    head = built / "head"
    before = snapshot(head)
    (tmp_path / "bench.json").write_text(json.dumps(RESULTS))

    rc = main(["push", str(head), REPO_ID, "--endpoint", hub.url, "--results", str(tmp_path / "bench.json")])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    files = hub.files(REPO_ID)
    commit = hub.repo(REPO_ID).refs["main"]
    assert f"{hub.url}/{REPO_ID}/commit/{commit}" in captured.out
    assert snapshot(head) == before  # README.md went to a temporary mirror, not into the folder
    assert set(before) | {"README.md"} <= set(files)
    assert all(files[name] == data for name, data in before.items())
    writes = [r for r in hub.requests if r.method == "POST"]
    assert writes and all(r.authorization == f"Bearer {TOKEN}" for r in writes)

    card = files["README.md"].decode()
    front_matter = card.split("---\n")[1]
    for line in ("- speculative-decoding", "- dflash2", f"base_model: {BASE_MODEL}", "library_name: transformers", "- humaneval"):
        assert line in front_matter
    assert f'AutoModel.from_pretrained("{REPO_ID}", trust_remote_code=True' in card
    assert f'"model": "{REPO_ID}", "num_speculative_tokens": 3' in card
    assert f"--speculative-draft-model-path {REPO_ID}" in card
    assert "| humaneval | 2.14 | 1.31× | 0.80, 0.55, 0.31 |" in card and RESULTS["command"] in card
    assert "**lr**" in card

    # A user without hf_dflash2 loads the head from the Hub (HF_ENDPOINT, fresh HF_HOME) as remote code.
    script = textwrap.dedent(
        f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] == "hf_dflash2":
                    raise ImportError("hf_dflash2 is blocked in this process")
        sys.meta_path.insert(0, Block())
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained({str(built / 'target')!r}).eval()
        drafter = AutoModel.from_pretrained({REPO_ID!r}, trust_remote_code=True).eval()
        assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
        drafter.bind_target(target)
        ids = torch.tensor([[5, 9, 17, 3, 44, 21, 8]])
        plain = target.generate(ids, max_new_tokens=8, do_sample=False)
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=8, do_sample=False)
        assert torch.equal(out, plain), (out, plain)
        print("OK", drafter.last_speculative_stats.rounds)
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
    assert any(r.path.endswith("/model.safetensors") and r.method == "GET" for r in hub.requests)
    assert hub.unhandled == []

    captured_later = capsys.readouterr()
    for text in (captured.out, captured.err, captured_later.out, captured_later.err, result.stdout, result.stderr):
        assert TOKEN not in text
    for root in (tmp_path, built):
        leaked = [p for p in root.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
        assert leaked == []
    assert not any(TOKEN.encode() in data for data in files.values())


def test_push_as_pull_request_leaves_main_alone(built, hub):
    head = built / "head"
    push_head(head, REPO_ID, endpoint=hub.url)
    main_before = hub.repo(REPO_ID).refs["main"]
    url = push_head(head, REPO_ID, endpoint=hub.url, create_pr=True, results=RESULTS)
    assert url == f"{hub.url}/{REPO_ID}/discussions/1"
    assert hub.repo(REPO_ID).refs["main"] == main_before
    assert "| gsm8k | 1.90 |" in hub.files(REPO_ID, "refs/pr/1")["README.md"].decode()
    assert "No measured acceptance length yet" in hub.files(REPO_ID)["README.md"].decode()


def _no_sleep_time():
    import time

    fake = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    fake.sleep = lambda seconds: None
    return fake


@pytest.mark.parametrize("path", ["pipelined", "single-commit"])
def test_failed_upload_raises_and_leaves_no_local_state(built, hub, monkeypatch, capsys, path):
    import huggingface_hub.utils._http as hf_http

    if path == "single-commit":
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    # The pipelined (hf_xet) path retries a 500 five times with backoff: skip the waits.
    monkeypatch.setattr(hf_http, "time", _no_sleep_time())
    head = built / "head"
    before, siblings, temp_dirs = snapshot(head), sorted(p.name for p in built.iterdir()), push_temp_dirs()
    hub.fail_commit_after = 0

    with pytest.raises(RuntimeError, match=rf"upload of .*head to {REPO_ID} failed: .*500") as info:
        push_head(head, REPO_ID, endpoint=hub.url)
    assert TOKEN not in str(info.value)
    assert hub.commit_attempts >= 1
    assert set(hub.files(REPO_ID)) == {".gitattributes"}  # the repo was created, nothing was committed
    assert snapshot(head) == before and not (head / "README.md").exists()
    assert sorted(p.name for p in built.iterdir()) == siblings
    assert push_temp_dirs() == temp_dirs

    assert main(["push", str(head), REPO_ID, "--endpoint", hub.url]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: upload of ") and "failed" in captured.err
    assert TOKEN not in captured.out + captured.err


def _not_a_head(tmp_path: Path, built: Path) -> tuple[Path, str]:
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes((built / "head" / "model.safetensors").read_bytes())
    return folder, "no dflash_config"


@pytest.mark.parametrize("case", ["not-a-head", "no-config", "bad-repo-id", "no-token"])
def test_bad_input_fails_before_any_request(built, hub, monkeypatch, tmp_path, capsys, case):
    folder, repo_id = built / "head", REPO_ID
    if case == "not-a-head":
        folder, message = _not_a_head(tmp_path, built)
    elif case == "no-config":
        folder, message = tmp_path / "empty", "has no config.json"
        folder.mkdir()
    elif case == "bad-repo-id":
        repo_id, message = "bad//id", "invalid repo id 'bad//id'"
    else:
        monkeypatch.delenv("HF_TOKEN")
        message = "no Hugging Face token: set HF_TOKEN or run `hf auth login`"
    before = snapshot(folder)

    with pytest.raises(ValueError, match=re.escape(message)):
        push_head(folder, repo_id, endpoint=hub.url)
    assert main(["push", str(folder), repo_id, "--endpoint", hub.url]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().startswith("error: ") and message in captured.err
    assert captured.out == ""
    assert hub.requests == []
    assert snapshot(folder) == before


def test_model_card_without_results_or_base_model(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    config = {"hidden_size": 64, "num_hidden_layers": 1, "dflash_config": {"block_size": 8, "target_layer_ids": [1, 2]}}
    (head / "config.json").write_text(json.dumps(config))
    card = render_model_card(head, "me/head")
    assert "base_model: unknown" in card and "- sharegpt" in card
    assert "No measured acceptance length yet" in card and '"num_speculative_tokens": 7' in card
    assert "base_model: org/target" in render_model_card(head, "me/head", base_model="org/target")
    assert (REPO / "src" / "hf_dflash2" / "model_cards" / "dflash2_head.md").exists()


def test_the_card_command_takes_the_base_model_and_refuses_a_repo_id_push_would_refuse(tmp_path, capsys):
    from hf_dflash2.cli import main

    head = tmp_path / "head"
    head.mkdir()
    config = {"hidden_size": 64, "num_hidden_layers": 1, "dflash_config": {"block_size": 8, "target_layer_ids": [1, 2]}}
    (head / "config.json").write_text(json.dumps(config))
    (head / "model.safetensors").write_bytes(b"")
    assert main(["card", str(head), "me/not a repo"]) == 2
    assert "invalid repo id 'me/not a repo'" in capsys.readouterr().err and not (head / "README.md").exists()
    assert main(["card", str(head), "me/head", "--base-model", "org/target"]) == 0
    assert "base_model: org/target" in (head / "README.md").read_text()


def test_a_gemma_base_model_heads_card_shows_plain_text_and_no_engine_it_cannot_run_on(tmp_path):
    """A head with Gemma's sandwich norms is not servable by vLLM or SGLang (Qwen3 layers), and a head distilled
    on a base model's plain continuations is used with plain text, not a chat template it does not have."""
    head = tmp_path / "head"
    head.mkdir()
    config = {"hidden_size": 64, "num_hidden_layers": 1,
              "dflash_config": {"block_size": 8, "target_layer_ids": [1, 2], "sandwich_norms": True}}
    (head / "config.json").write_text(json.dumps(config))
    (head / "training_recipe.json").write_text(json.dumps({"chat_template_used": "plain"}))
    card = render_model_card(head, "me/head", base_model="google/gemma-3-270m")
    assert "vllm serve" not in card and "sglang.launch_server" not in card and "cannot serve it" in card
    assert 'tokenizer("def quicksort(items):"' in card and "apply_chat_template" not in card
    (head / "training_recipe.json").write_text(json.dumps({"chat_template_used": "tokenizer"}))
    config["dflash_config"].pop("sandwich_norms")
    (head / "config.json").write_text(json.dumps(config))
    card = render_model_card(head, "me/head", base_model="org/target")
    assert "vllm serve org/target" in card and "apply_chat_template" in card


def test_dry_run_writes_what_would_be_uploaded_without_token_or_network(built, hub, monkeypatch, tmp_path, capsys):
    from transformers import AutoModel

    monkeypatch.delenv("HF_TOKEN", raising=False)
    folder = built / "head"
    before = snapshot(folder)
    out = tmp_path / "staged"
    assert main(["push", str(folder), REPO_ID, "--endpoint", hub.url, "--dry-run", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert hub.requests == [] and snapshot(folder) == before
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    for name in ("config.json", "model.safetensors", "README.md", "modeling_dflash2.py", "custom_generate/generate.py"):
        assert name in names, name
    assert not any(p.is_symlink() for p in out.rglob("*"))  # copies: the folder stands on its own
    assert f"# {REPO_ID.split('/')[-1]}" in (out / "README.md").read_text()
    AutoModel.from_pretrained(out, trust_remote_code=True)
    with pytest.raises(ValueError, match="must be a new or empty folder"):
        push_head(folder, REPO_ID, dry_run=out)


def test_save_pretrained_with_push_to_hub_uploads_the_complete_head(hub, tmp_path, monkeypatch):
    """``drafter.save_pretrained(out, push_to_hub=True)`` (the usual training-script line) uploads what a local
    save writes, the draft vocabulary and ``custom_generate/`` included: Transformers uploads inside its own
    save, before the head's extra files exist."""
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)  # read at import; Transformers' push takes no endpoint
    drafter = tiny_drafter(tiny_target(vocab_size=64))
    drafter.set_draft_vocab(torch.arange(0, 64, 2))
    drafter.save_pretrained(tmp_path / "head", push_to_hub=True, repo_id=REPO_ID, commit_message="a head")
    files = hub.files(REPO_ID)
    for name in ("config.json", "model.safetensors", "draft_vocab.json", "custom_generate/generate.py",
                 "modeling_dflash2.py"):
        assert name in files, name
    assert json.loads(files["draft_vocab.json"])["token_ids"] == list(range(0, 64, 2))
    assert json.loads(files["config.json"])["architectures"] == ["DFlash2DraftModel"]
    local = {p.relative_to(tmp_path / "head").as_posix(): p.read_bytes()
             for p in (tmp_path / "head").rglob("*") if p.is_file()}
    assert all(files[name] == data for name, data in local.items())  # the folder written, byte for byte
