"""Head folders on disk and on the Hub: atomic saving with remote code, model cards, pushing."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

HEAD_FILES = ("config.json", "model.safetensors")


def check_replaceable(folder: str | Path) -> None:
    """Refuse a ``save_head`` target that exists without being a head: the save replaces the whole folder."""
    folder = Path(folder)
    if folder.exists() and not (folder / "config.json").is_file():
        raise ValueError(f"{folder} exists and is not a saved head: saving would replace it; pick a new folder")


def save_head(drafter, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Save a drafter as a Hub-ready head: safetensors, config with ``auto_map``, remote-code files.

    Written into a temporary sibling folder and swapped in, so an interrupted save never leaves a
    half-written head. ``dtype`` (e.g. ``torch.bfloat16``) converts a copy, not the live drafter.
    ``folder`` must be new or a saved head (``check_replaceable``).
    """
    folder = Path(folder)
    check_replaceable(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    model = drafter
    if dtype is not None and next(drafter.parameters()).dtype != dtype:
        import copy

        bound = drafter.__dict__.pop("_bound_target", None)  # never copy the target's weights
        rows = drafter.__dict__.pop("_draft_head", None)  # nor the draft vocabulary's rows of its LM head
        try:
            model = copy.deepcopy(drafter).to(dtype)
        finally:
            if bound is not None:
                drafter.__dict__["_bound_target"] = bound
            if rows is not None:
                drafter.__dict__["_draft_head"] = rows
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        model.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a published head is world-readable
        for path in tmp.rglob("*"):  # folders (custom_generate/) must stay searchable
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        keep = {"README.md"}
        if folder.exists():
            for name in keep:
                if (folder / name).exists() and not (tmp / name).exists():
                    shutil.copy2(folder / name, tmp / name)
            old = folder.with_name(f".{folder.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def write_remote_code(folder: str | Path) -> list[str]:
    """Write the drafter's code into a head folder: what ``save_pretrained`` writes, for heads kept without it.

    The modeling file and every sibling it imports, ``custom_generate/generate.py``, and ``auto_map`` in
    ``config.json``; existing files (or links) of those names are replaced. Returns the written names.
    """
    from transformers.dynamic_module_utils import get_relative_import_files

    from . import custom_generate_dflash2, modeling_dflash2

    folder = Path(folder)
    modeling = Path(modeling_dflash2.__file__)
    copies = {path.name: path for path in map(Path, [modeling, *get_relative_import_files(modeling)])}
    copies["custom_generate/generate.py"] = Path(custom_generate_dflash2.__file__)
    for name, source in copies.items():
        destination = folder / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.unlink(missing_ok=True)  # a link into the original folder must not be written through
        shutil.copyfile(source, destination)
    config_path = folder / "config.json"
    config = _read_json(config_path)
    architecture = (config.get("architectures") or ["DFlash2DraftModel"])[0]
    if architecture not in ("DFlash2DraftModel", "DFlashDraftModel"):
        architecture = "DFlash2DraftModel"
    auto_map = {"AutoConfig": "configuration_dflash2.DFlash2Config", "AutoModel": f"modeling_dflash2.{architecture}"}
    if config.get("auto_map") != auto_map:
        config["auto_map"] = auto_map
        config_path.unlink()
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return sorted([*copies, "config.json"])


def is_head_folder(folder: str | Path) -> tuple[bool, str]:
    """(ok, reason): a folder with a dFlash config and safetensors weights."""
    folder = Path(folder)
    if not folder.is_dir():
        return False, f"{folder} is not a folder"
    for name in HEAD_FILES:
        if not (folder / name).exists():
            return False, f"{folder} has no {name}"
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as error:
        return False, f"{folder}/config.json is not valid JSON ({error})"
    if "dflash_config" not in config:
        return False, f"{folder}/config.json has no dflash_config: not a DFlash head"
    return True, ""


# ----------------------------------------------------------------------------------------- model card

MODEL_CARD_TEMPLATE = "model_cards/dflash2_head.md"  # package data of hf_dflash2
DEFAULT_CARD_DATASETS = ("sharegpt",)


def default_card_template() -> str:
    """The packaged model card template (works from a wheel as from a checkout)."""
    from importlib.resources import files

    resource = files("hf_dflash2").joinpath(MODEL_CARD_TEMPLATE)
    if not resource.is_file():
        raise FileNotFoundError(f"hf_dflash2/{MODEL_CARD_TEMPLATE} is missing from the installed package: reinstall it")
    return resource.read_text(encoding="utf-8")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return value


def _load_results(results) -> dict | None:
    """``results`` as a dict: given as one, or as the path of a benchmark JSON."""
    if results is None or isinstance(results, dict):
        return results
    return _read_json(Path(results))


def _yaml_scalar(value) -> str:
    """A YAML-safe scalar (JSON strings are valid YAML flow scalars)."""
    text = str(value)
    if text and all(c.isalnum() or c in "-_./" for c in text) and text[0] not in "-.":
        return text
    return json.dumps(text)


def _fmt_number(value, digits: int = 2) -> str:
    if isinstance(value, bool) or value is None:
        return "–"
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}"
    return str(value)


def baseline_names() -> dict[str, str]:
    """How a card names each plain configuration of ``hf-dflash2 bench`` (``PLAIN_CONFIGURATIONS``), for its
    sentence on the baseline."""
    from .evaluation.bench import PLAIN_CONFIGURATIONS  # imported here: the bench module imports this one

    return {method: configuration.card_name for method, configuration in PLAIN_CONFIGURATIONS.items()}


def _results_section(results: dict | None, drafts: int | None = None) -> str:
    if not results or not results.get("datasets"):
        return "No measured acceptance length yet: run `hf-dflash2 bench` and push again with `--results`."
    rows = [
        "| dataset | τ (tokens per target forward, bonus included) | speedup over the fastest plain `generate` "
        "| per-position acceptance (conditional) |",
        "|---|---|---|---|",
    ]
    for name, entry in results["datasets"].items():
        entry = entry if isinstance(entry, dict) else {"tau": entry}
        per_position = (entry.get("per_position_acceptance") or [])[:drafts]  # deeper: n-gram drafts only
        per_position = ", ".join(_fmt_number(p) for p in per_position) if per_position else "–"
        speedup = entry.get("speedup")
        speedup = f"{_fmt_number(speedup)}×" if isinstance(speedup, (int, float)) and not isinstance(speedup, bool) else "–"
        rows.append(f"| {name} | {_fmt_number(entry.get('tau'))} | {speedup} | {per_position} |")
    lines = ["\n".join(rows)]
    if results.get("method"):
        note = f": {results['method_note']}" if results.get("method_note") else ""
        lines.append(f"Method: `{results['method']}`{note}.")
    if results.get("with_ngram_drafts"):
        parts = [f"{name} τ {_fmt_number(e.get('tau'))}, {_fmt_number(e.get('speedup'))}×"
                 for name, e in results["with_ngram_drafts"].items()]
        lines.append("With `hf_dflash2`'s fast loop as it runs by default (n-gram (prompt lookup) drafts next to "
                     "the head's, verified with the head's likeliest continuations as one draft tree), same run: "
                     + "; ".join(parts) + ".")
    # a report from before the key was recorded timed the two linear kernels
    names = baseline_names()
    baselines = [names.get(m, f"`{m}`") for m in results.get("baselines", ("ar", "ar_onednn"))]
    if len(baselines) > 1:
        lines.append("Each speedup is over the fastest plain `generate` the machine had for the target in the same "
                     f"dtype (timed on {', '.join(baselines[:-1])} and {baselines[-1]}; the fastest), measured in "
                     "one process, interleaved.")
    elif baselines:
        lines.append(f"Each speedup is over plain `generate` on {baselines[0]}, measured in one process, interleaved.")
    else:
        lines.append("No plain `generate` was timed in this run, so no speedup is shown.")
    details = [f"{key}: {results[key]}" for key in ("target", "device", "dtype", "temperature", "max_new_tokens") if key in results]
    if details:
        lines.append("Measured with " + ", ".join(details) + ".")
    if results.get("command"):
        lines.append(f"Command:\n\n```bash\n{results['command']}\n```")
    return "\n\n".join(lines)


def _recipe_section(head_folder: Path) -> str:
    path = head_folder / "training_recipe.json"
    if not path.exists():
        return "No `training_recipe.json` was saved with this head."
    recipe = _read_json(path)
    lines = []
    for key, value in recipe.items():
        if isinstance(value, (dict, list)):
            value = json.dumps(value)
        lines.append(f"- **{key}**: `{value}`")
    return "\n".join(lines) if lines else "`training_recipe.json` is empty."


def _inputs_code(head_folder: Path) -> str:
    """The usage example's prompt: a chat turn, or plain text for a head distilled on a base model's own
    continuations (its ``training_recipe.json`` says the run had no chat template)."""
    recipe_path = head_folder / "training_recipe.json"
    if recipe_path.exists() and _read_json(recipe_path).get("chat_template_used") == "plain":
        return 'inputs = tokenizer("def quicksort(items):", return_tensors="pt").to(target.device)'
    return ('inputs = tokenizer.apply_chat_template(\n'
            '    [{"role": "user", "content": "Write a quicksort in Python."}],\n'
            '    add_generation_prompt=True, return_tensors="pt", return_dict=True,\n'
            ').to(target.device)')


def _serving_section(dflash: dict, target: str, repo_id: str, speculative_tokens: int) -> str:
    """vLLM and SGLang serve the published (Qwen3-layer) format; a head with Gemma's sandwich norms is ours only."""
    if dflash.get("sandwich_norms"):
        return ("This head's layers norm each sublayer's output, as its Gemma target's do "
                "(`dflash_config.sandwich_norms`). vLLM's and SGLang's DFlash drafters have Qwen3 layers and cannot "
                "serve it: use `hf_dflash2` (above, or `hf_dflash2.speculative_generate`).")
    return (f"vLLM:\n\n```bash\nvllm serve {target} --speculative-config '{{\"method\": \"dflash\", \"model\": "
            f"\"{repo_id}\", \"num_speculative_tokens\": {speculative_tokens}}}'\n```\n\nSGLang:\n\n```bash\n"
            f"python -m sglang.launch_server --model {target} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {repo_id}\n```")


def _card_datasets(results: dict | None, head_folder: Path) -> list[str]:
    if results:
        for key in ("train_datasets", "training_datasets"):
            if isinstance(results.get(key), list) and results[key]:
                return [str(d) for d in results[key]]
        if isinstance(results.get("datasets"), dict) and results["datasets"]:
            return [str(d) for d in results["datasets"]]
    recipe = head_folder / "training_recipe.json"
    if recipe.exists():
        datasets = _read_json(recipe).get("datasets")
        if isinstance(datasets, list) and datasets:
            return [str(d) for d in datasets]
    return list(DEFAULT_CARD_DATASETS)


HEAD_ONLY_METHOD, HYBRID_METHOD = "dflash2_fast_head", "dflash2_fast"
METHOD_NOTES = {
    HEAD_ONLY_METHOD: "the head's own drafts, their verify length chosen by the adaptive policy",
    HYBRID_METHOD: "hf_dflash2's fast loop with its defaults: n-gram drafts next to the head's, and draft trees",
    "dflash2_fixed_block": "the head's whole block verified every round, no n-gram drafts, no trees, as vLLM and "
                           "SGLang verify it (the head's held-out τ)",
}


def card_results(report: dict, method: str) -> dict:
    """The model card's results block for one method of a bench report. A report from before the
    head-only method existed falls back to ``dflash2_fast``, whose drafts were then the head's alone.
    Showing the head alone, the card also quotes the n-gram hybrid's numbers when the report has them."""
    first = next(iter(report["datasets"].values()), {})
    if method == HEAD_ONLY_METHOD and HEAD_ONLY_METHOD not in first and HYBRID_METHOD in first:
        method = HYBRID_METHOD
    datasets = {}
    for name, methods in report["datasets"].items():
        if method in methods:
            entry = methods[method]
            datasets[name] = {"tau": entry.get("tau"), "per_position_acceptance": (entry.get("per_position_acceptance") or [])[:8],
                              "speedup": entry.get("speedup_vs_ar")}
    if not datasets:
        raise ValueError(f"method {method!r} is not in this report (methods: {sorted(next(iter(report['datasets'].values())))})")
    settings = report["settings"]
    also = {}
    if method == HEAD_ONLY_METHOD:
        also = {name: {"tau": methods[HYBRID_METHOD].get("tau"), "speedup": methods[HYBRID_METHOD].get("speedup_vs_ar")}
                for name, methods in report["datasets"].items() if HYBRID_METHOD in methods}
    return {
        "method": method,
        "baselines": [m for m in first if m in baseline_names()],  # the plain configurations the report timed
        **({"method_note": METHOD_NOTES[method]} if method in METHOD_NOTES else {}),
        **({"with_ngram_drafts": also} if also else {}),
        "datasets": datasets,
        "train_datasets": ["anon8231489123/ShareGPT_Vicuna_unfiltered"],
        "device": report["machine"].get("device", "cpu") + " (" + (
            f"{report['machine']['processor']}, " if report["machine"].get("processor") else "")
        + f"{report['machine']['threads']} threads)",
        **({"dtype": report["machine"]["dtype"]} if "dtype" in report["machine"] else {}),
        "temperature": settings["temperature"],
        "max_new_tokens": settings["max_new_tokens"],
        "command": report["command"],
    }


def load_card_results(path: str | Path | None, method: str = HEAD_ONLY_METHOD) -> dict | None:
    """A results JSON for the card: a ``hf-dflash2 bench`` report (turned into ``method``'s numbers) or a
    ready ``{"datasets": ...}`` block."""
    if path is None:
        return None
    data = _read_json(Path(path))
    if "settings" in data and "machine" in data:
        return card_results(data, method)
    return data


def render_model_card(
    head_folder: str | Path,
    repo_id: str,
    results: dict | str | Path | None = None,
    template: str | Path | None = None,
    base_model: str | None = None,
) -> str:
    """The README.md of a head pushed as ``repo_id``: YAML metadata, usage, serving, τ table, recipe.

    ``base_model`` comes from the head's ``config.json`` field ``"base_model"``, else the argument, else
    ``"unknown"``. ``results`` is a benchmark JSON (dict or path) shaped like
    ``{"datasets": {"humaneval": {"tau": 2.1, "per_position_acceptance": [...], "speedup": 1.3}}, "command": "..."}``.
    ``template`` is a path (or the text) of a ``string.Template`` file; default: the packaged ``hf_dflash2/model_cards/dflash2_head.md``.
    """
    from string import Template

    head_folder = Path(head_folder)
    config = _read_json(head_folder / "config.json")
    results = _load_results(results)
    if template is None:
        text = default_card_template()
    elif isinstance(template, str) and "\n" in template:
        text = template
    else:
        text = Path(template).read_text(encoding="utf-8")

    base = config.get("base_model") or base_model or "unknown"
    dflash = config.get("dflash_config") or {}
    block_size = int(dflash.get("block_size", 16))
    dflash2 = bool(dflash.get("conv_kernel_size") or dflash.get("selector_rank"))
    values = {
        "base_model": _yaml_scalar(base),
        "target_model": base if base != "unknown" else "YOUR_TARGET_MODEL",
        "base_model_ref": f"[`{base}`](https://huggingface.co/{base})" if base != "unknown" else "its target model",
        "repo_id": repo_id,
        "title": repo_id.split("/")[-1],
        "variant": "dFlash 2" if dflash2 else "DFlash",
        "datasets_yaml": "\n".join(f"- {_yaml_scalar(d)}" for d in _card_datasets(results, head_folder)),
        "block_size": block_size,
        "num_speculative_tokens": block_size - 1,
        "target_layer_ids": ", ".join(str(i) for i in dflash.get("target_layer_ids", [])) or "–",
        "num_hidden_layers": config.get("num_hidden_layers", "–"),
        "hidden_size": config.get("hidden_size", "–"),
        "results_section": _results_section(results, block_size - 1),
        "recipe_section": _recipe_section(head_folder),
        "inputs_code": _inputs_code(head_folder),
        "serving_section": _serving_section(dflash, base if base != "unknown" else "YOUR_TARGET_MODEL", repo_id,
                                            block_size - 1),
    }
    return Template(text).substitute(values)


# ----------------------------------------------------------------------------------------- push


def _link_tree(source: Path, destination: Path, copy: bool = False) -> None:
    """Mirror ``source`` into ``destination`` with symlinks (copies where links are not allowed, or with ``copy``)."""
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if relative.parts[0] in (".git", ".cache") or not path.is_file():
            continue
        if relative.as_posix() == "README.md":
            continue  # replaced by the rendered card
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if not copy:
            try:
                os.symlink(path.resolve(), target)
                continue
            except OSError:
                pass
        shutil.copy2(path, target)


def _stage_upload(head_folder: Path, staging: Path, card: str, copy: bool = False) -> None:
    """``staging`` as the Hub repo will hold it: the head's files, this package's code, the rendered card."""
    staging.mkdir(parents=True, exist_ok=True)
    _link_tree(head_folder, staging, copy=copy)
    write_remote_code(staging)  # the code of this package version, not whatever the folder holds
    (staging / "README.md").write_text(card, encoding="utf-8")


def check_repo_id(repo_id: str) -> None:
    """Refuse, by name, a repo id the Hub would refuse (before any upload, card or training)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"invalid repo id {repo_id!r}: {error}") from None


def push_head(
    head_folder: str | Path,
    repo_id: str,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    results: dict | str | Path | None = None,
    endpoint: str | None = None,
    base_model: str | None = None,
    commit_message: str | None = None,
    dry_run: str | Path | None = None,
) -> str:
    """Upload a head folder (weights, config, remote code) plus a rendered model card to the Hub.

    ``dry_run``: a new folder that receives, as copies, exactly what would be uploaded; no token, no network.

    Everything is checked before the first request: the folder, the repo id, the token. The card is
    written into a temporary mirror of the folder, never into ``head_folder`` itself. Returns the commit
    URL (the pull-request URL with ``create_pr``). Raises ``ValueError`` for bad input and
    ``RuntimeError`` when the Hub refuses or fails the upload.
    """
    import huggingface_hub

    head_folder = Path(head_folder)
    ok, reason = is_head_folder(head_folder)
    if not ok:
        raise ValueError(reason)
    check_repo_id(repo_id)
    if create_pr and revision not in (None, "main"):
        raise ValueError("--create-pr opens the pull request against the default branch: do not combine it with --revision")
    if dry_run is not None:
        staging = Path(dry_run)
        if staging.exists() and (not staging.is_dir() or any(staging.iterdir())):
            raise ValueError(f"--dry-run {dry_run}: must be a new or empty folder")
        card = render_model_card(head_folder, repo_id, results=_load_results(results), base_model=base_model)
        _stage_upload(head_folder, staging, card, copy=True)
        return str(staging)
    if token is None:
        try:
            token = huggingface_hub.get_token()
        except Exception as error:  # e.g. a failed OIDC exchange
            raise ValueError(f"no usable Hugging Face token: {type(error).__name__}") from None
    if not token:
        raise ValueError("no Hugging Face token: set HF_TOKEN or run `hf auth login`")
    results = _load_results(results)
    card = render_model_card(head_folder, repo_id, results=results, base_model=base_model)

    api = huggingface_hub.HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory(prefix="hf-dflash2-push-") as tmp:
        staging = Path(tmp) / head_folder.name
        _stage_upload(head_folder, staging, card)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            info = api.upload_folder(
                folder_path=staging,
                repo_id=repo_id,
                revision=revision,
                create_pr=create_pr,
                commit_message=commit_message or "Upload DFlash drafter head with hf-dflash2",
            )
        except Exception as error:
            message = str(error).replace(token, "***")
            raise RuntimeError(f"upload of {head_folder} to {repo_id} failed: {message}") from error
    url = (info.pr_url if create_pr else None) or info.commit_url or info.oid
    return str(url)
