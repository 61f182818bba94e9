"""Grouped-query SDPA without copies of the keys and values: the target's attention in the fast loop.

A target with grouped-query attention (SmolLM2: 9 query heads share 3 key/value heads) runs Transformers'
``sdpa`` attention one of three ways. With a mask and more than one query, ``repeat_kv`` first copies every
cached key and value once per query head of its group; with no mask, SDPA's own ``enable_gqa`` runs, which
on CPU in bf16 takes a slow path; only a single query with a mask is packed. Speculation meets the first two
at every round: a verify has several queries and a mask, and a batch-1 plain step has no mask.

``packed_gqa_sdpa`` packs in every case where a mask says what each query sees (or there is one query): the
``g`` query heads of a group become ``g`` times as many queries of its key/value head, and the mask is
repeated to match, so SDPA reads each cached key and value once. Each query's softmax is over the same keys
with the same mask, so the result is the same attention; only the kernel's order of summation may differ
(last bits in fp32, as between Transformers' own one-token and many-token forwards). It is never slower beyond
noise, and faster most at batch 8 (``docs/benchmarks.md``).

``packed_gqa_attention(model)`` switches a model to it for the duration of a ``with`` block (the fast loop
does, for its whole call); ``model.set_attn_implementation(PACKED_GQA_SDPA)`` after ``import hf_dflash2``
switches it for good, e.g. to give plain ``generate`` the same attention.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_GQA_SDPA = "packed_gqa_sdpa"
# Models whose attention only dispatches through Transformers' attention-function registry (their modeling
# files never test the implementation's name): switching them changes nothing but the function that runs.
# Some other models branch on ``_attn_implementation in ("eager", "sdpa")`` and would take another path.
PACKABLE_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
                                  "gemma3_text", "smollm3", "phi3", "olmo2", "granite"})
# Longer forwards (prefills) keep Transformers' path: the repeated mask grows as queries x keys x g.
MAX_PACKED_QUERIES = 64


def packed_gqa_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature: query [N, Hq, w, d], key / value [N, Hkv, T, d],
    attention_mask [N or 1, 1 or Hq, w, T] (bool or additive) or None -> ([N, w, Hq, d], None).

    Packs the ``g = Hq / Hkv`` query heads of each group into the query axis when a 4-D mask with one row
    per query is given or there is one query, for up to ``MAX_PACKED_QUERIES`` queries; otherwise (no GQA,
    no mask over several queries, which is a causal prefill, a long forward, a mask broadcast over queries,
    arguments such as a position bias) Transformers' ``sdpa`` runs as it would."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, query_heads, width, dim = query.shape
    mask = attention_mask
    one_row_per_query = mask is not None and mask.dim() == 4 and mask.shape[1] in (1, query_heads) \
        and mask.shape[2] == width
    if (groups == 1 or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or (mask is None and width > 1) or (mask is not None and not one_row_per_query)
            or width > MAX_PACKED_QUERIES or key.shape[0] != batch or key.shape[-1] != value.shape[-1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kv_heads = key.shape[1]
    packed_query = query.reshape(batch, kv_heads, groups * width, dim)  # head h = kv * g + j -> (kv, j * w + i)
    if mask is not None:
        rows, total = mask.shape[0], mask.shape[-1]
        if mask.shape[1] == 1:
            mask = mask[:, :, None].expand(rows, 1, groups, width, total).reshape(rows, 1, groups * width, total)
        else:
            mask = mask.reshape(rows, kv_heads, groups * width, total)
    out = torch.nn.functional.scaled_dot_product_attention(packed_query, key, value, attn_mask=mask,
                                                           dropout_p=dropout, scale=scaling)
    return out.reshape(batch, query_heads, width, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_GQA_SDPA, packed_gqa_sdpa)
AttentionMaskInterface.register(PACKED_GQA_SDPA, sdpa_mask)  # the masks Transformers builds for sdpa


def packs_gqa(model) -> bool:
    """Whether ``packed_gqa_attention`` would switch this model: plain ``sdpa`` on one config (not a
    composite model's sub-configs) of a ``PACKABLE_MODEL_TYPES`` model with grouped-query attention."""
    config = model.config
    if (getattr(config, "_attn_implementation", None) != "sdpa" or config.get_text_config() is not config
            or getattr(config, "model_type", None) not in PACKABLE_MODEL_TYPES):
        return False
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    return bool(heads and kv_heads and kv_heads < heads)


@contextmanager
def packed_gqa_attention(model, enabled: bool = True):
    """Within the block, ``model`` runs ``packed_gqa_sdpa`` where it ran ``sdpa`` with grouped-query
    attention (``packs_gqa``); its attention implementation is restored on the way out, errors included.

    The switch is made on the model's config, so another thread running the same model meanwhile runs the
    packed attention too (the same attention, last bits aside)."""
    if not (enabled and packs_gqa(model)):
        yield
        return
    previous = model.config._attn_implementation
    model.config._attn_implementation = PACKED_GQA_SDPA
    try:
        yield
    finally:
        model.config._attn_implementation = previous
