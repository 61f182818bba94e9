"""Transformers' ``custom_generate`` entry point for a dFlash 2 head folder.

Saving a head writes this file as ``custom_generate/generate.py``, so that

    target.generate(**inputs, custom_generate="you/Qwen3-8B-dflash2", trust_remote_code=True)

loads the head (weights and remote code from the same folder or repo) and runs
``generate(assistant_model=head)``: lossless speculative decoding at batch size 1, with no import of
``hf_dflash2``. Only torch and transformers are imported here, and no sibling file: Transformers loads
this file on its own, from the ``custom_generate`` subfolder.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModel

_DRAFTERS: dict = {}  # (head, dtype, device) -> drafter, so repeated calls do not reload the head


def _head_reference() -> str:
    """The ``custom_generate=`` argument of the ``generate`` call that is running us.

    Transformers hands the custom function the arguments of ``generate`` but not ``custom_generate`` itself,
    and the head's weights live where this file came from, so we read it from the calling frame.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "generate" and isinstance(frame.f_locals.get("custom_generate"), str):
            return frame.f_locals["custom_generate"]
        frame = frame.f_back
    raise ValueError(
        "dFlash 2 custom_generate: cannot find the head folder; call target.generate(..., custom_generate=HEAD, "
        "trust_remote_code=True) or pass assistant_model=AutoModel.from_pretrained(HEAD, trust_remote_code=True)"
    )


def load_drafter(head: str, model) -> torch.nn.Module:
    """The head at ``head`` (folder or Hub id) in the target's dtype and device, cached per process."""
    key = (head, model.dtype, str(model.device))
    if key not in _DRAFTERS:
        drafter = AutoModel.from_pretrained(head, trust_remote_code=True, dtype=model.dtype)
        _DRAFTERS[key] = drafter.to(model.device).eval()
    return _DRAFTERS[key]


def check_before_loading(model, args: tuple, kwargs: dict) -> None:
    """What the assisted loop refuses anyway (more than one row, beams, several sequences per prompt), refused
    by value before the head is loaded, or downloaded."""
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] != 1:
        raise ValueError(f"a dFlash 2 head's custom_generate runs at batch size 1 (got {ids.shape[0]} rows); batch "
                         "the prompts with hf_dflash2.speculative_generate")
    config = kwargs.get("generation_config") or model.generation_config
    for name in ("num_beams", "num_return_sequences"):
        value = kwargs.get(name, getattr(config, name, None))
        if isinstance(value, int) and value > 1:
            raise ValueError(f"{name}={value} is not supported with a dFlash 2 head (batch size 1, one sequence)")


def generate(model, *args, assistant_model=None, **kwargs):
    """``model.generate(*args, **kwargs)`` with this head as the assistant (batch size 1, any sampling)."""
    if assistant_model is None:
        check_before_loading(model, args, kwargs)
    drafter = assistant_model if assistant_model is not None else load_drafter(_head_reference(), model)
    if not hasattr(drafter, "get_candidate_generator"):
        raise ValueError(f"{type(drafter).__name__} is not a dFlash 2 / DFlash head (no get_candidate_generator)")
    return model.generate(*args, assistant_model=drafter, **kwargs)
