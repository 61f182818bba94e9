"""Head folders on disk and on the Hub: atomic saving with remote code, model cards, pushing."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

HEAD_FILES = ("config.json", "model.safetensors")


def save_head(drafter, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Save a drafter as a Hub-ready head: safetensors, config with ``auto_map``, remote-code files.

    Written into a temporary sibling folder and swapped in, so an interrupted save never leaves a
    half-written head. ``dtype`` (e.g. ``torch.bfloat16``) converts a copy, not the live drafter.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    model = drafter
    if dtype is not None and next(drafter.parameters()).dtype != dtype:
        import copy

        bound = drafter.__dict__.pop("_bound_target", None)  # never copy the target's weights
        try:
            model = copy.deepcopy(drafter).to(dtype)
        finally:
            if bound is not None:
                drafter.__dict__["_bound_target"] = bound
    model.config.register_for_auto_class()
    type(model).register_for_auto_class("AutoModel")
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        model.save_pretrained(tmp)
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
