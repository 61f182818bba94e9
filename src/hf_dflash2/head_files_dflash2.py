"""A saved head's files beside its weights: checks that run before ``from_pretrained`` reads them, and the
writes ``save_pretrained`` adds to Transformers' own.

Each check raises ``HeadFileError`` naming the file and what is wrong with it, so a truncated download or a
config from another model fails before any weight is loaded. Writes go through a hidden temporary file in the
same folder and ``os.replace``, so a kill leaves the old file or the new one, never half of either (a kill
between the two may leave the hidden temporary behind).
"""

from __future__ import annotations

import json
import os
import uuid

DRAFT_VOCAB_FILE = "draft_vocab.json"
REQUIRED_DFLASH_FIELDS = ("block_size", "mask_token_id", "target_layer_ids")


class HeadFileError(ValueError):
    """A head file that is incomplete or inconsistent; the message names the file and the problem."""


def head_file(name_or_path, filename: str, hub_kwargs: dict) -> str | None:
    """The local path of a head's file (a Hub head's is fetched into the cache), or None if it has none."""
    from transformers.utils import cached_file

    return cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False, **hub_kwargs)


def check_head_config(path: str | None) -> None:
    """A head's ``config.json`` must carry the ``dflash_config`` fields that no default can stand in for."""
    if path is None:
        return  # from_pretrained reports the missing file itself
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as error:
        raise HeadFileError(f"{path}: cannot read the config ({error})") from None
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        raise HeadFileError(f"{path}: no dflash_config block, so this is not a DFlash / dFlash 2 head")
    missing = [name for name in REQUIRED_DFLASH_FIELDS if name not in dflash]
    if missing:
        raise HeadFileError(f"{path}: dflash_config lacks {missing} (it has {sorted(dflash)})")


def safetensors_files(name_or_path, hub_kwargs: dict) -> list[str]:
    """The head's weight files (local paths; a Hub head's are fetched into the cache, where ``from_pretrained``
    then finds them): ``model.safetensors``, or the shards its index names."""
    single = head_file(name_or_path, "model.safetensors", hub_kwargs)
    if single:
        return [single]
    index = head_file(name_or_path, "model.safetensors.index.json", hub_kwargs)
    if not index:
        return []
    try:
        with open(index, encoding="utf-8") as handle:
            shards = sorted(set(json.load(handle)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise HeadFileError(f"{index}: not a valid safetensors index ({error})") from None
    return [path for path in (head_file(name_or_path, shard, hub_kwargs) for shard in shards) if path]


def check_safetensors_complete(path: str | None) -> None:
    """The file must be as long as its header says (an interrupted copy or download is shorter)."""
    if path is None:
        return
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(8)
        header_length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if header_length < 2 or 8 + header_length > size:
            raise HeadFileError(f"{path}: truncated or not a safetensors file ({size} bytes)")
        try:
            header = json.loads(handle.read(header_length))
        except ValueError:
            raise HeadFileError(f"{path}: unreadable safetensors header ({size} bytes)") from None
    end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
    if 8 + header_length + end > size:
        raise HeadFileError(f"{path}: truncated: the header needs {8 + header_length + end} bytes, the file has {size}")


def read_draft_vocab(path: str) -> list[int]:
    """The token ids of a ``draft_vocab.json``; ``ValueError`` unless it is ``{"token_ids": [...]}`` (the ids
    themselves are checked against the vocabulary by ``DFlash2DraftModel.set_draft_vocab``)."""
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict) or not isinstance(data.get("token_ids"), list):
        raise ValueError('expected {"token_ids": [...]}')
    return data["token_ids"]


def _replace_atomically(path: str, text: str) -> None:
    folder, name = os.path.split(path)
    # created as open() would create the file, under the process's umask (changing the umask to read it
    # would race with other threads of the user's process)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_draft_vocab(folder: str, token_ids: list[int]) -> None:
    _replace_atomically(os.path.join(folder, DRAFT_VOCAB_FILE), json.dumps({"token_ids": token_ids}))


def write_architectures(folder: str, architectures: list[str]) -> None:
    """Sets ``architectures`` in the folder's ``config.json`` (the name a DFlash 1 head is published under
    differs from the class that saved it)."""
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if data.get("architectures") != architectures:
        data["architectures"] = architectures
        _replace_atomically(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
