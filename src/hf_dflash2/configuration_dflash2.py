"""Configuration of a dFlash 2 (or DFlash 1) drafter, in the field names of the published checkpoints.

A head's ``config.json`` is a Qwen3 config (``"model_type": "qwen3"``) plus ``num_target_layers`` and a
``dflash_config`` block. The conv and the path selector are on exactly when their fields are present in
``dflash_config`` (``conv_kernel_size`` / ``selector_rank``): DFlash 1 heads simply do not have them.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

DFLASH2_DEFAULTS = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
}

# gamma of the position-decayed loss, by block size (DFlash paper); other sizes interpolate.
LOSS_DECAY_BY_BLOCK_SIZE = {16: 7.0, 10: 5.0, 8: 4.0}


@strict
class DFlash2Config(Qwen3Config):
    r"""
    dflash_config (`dict`):
        ``block_size``, ``mask_token_id``, ``target_layer_ids`` and, for dFlash 2, ``conv_kernel_size``,
        ``conv_group_size``, ``selector_rank``, ``selector_top_k``; optional ``output_multiplier``,
        ``final_logit_softcapping``, ``input_embedding_scale``, ``sandwich_norms`` (Gemma-style layers: each
        sublayer's output normed before the residual add; such heads need this file, not a Qwen3 loader).
    num_target_layers (`int`):
        Number of decoder layers of the target model the head was trained for.
    """

    dflash_config: dict | None = None
    num_target_layers: int | None = None
    is_causal: bool = False

    def __post_init__(self, **kwargs):
        if self.dflash_config is None:
            self.dflash_config = {}
        self.dflash_config = dict(self.dflash_config)
        self.dflash_config.setdefault("block_size", 16)
        self.dflash_config.setdefault("mask_token_id", 0)
        if "target_layer_ids" not in self.dflash_config and self.num_target_layers:
            self.dflash_config["target_layer_ids"] = default_target_layer_ids(
                self.num_target_layers, self.num_hidden_layers
            )
        self.dflash_config.setdefault("target_layer_ids", [0])
        super().__post_init__(**kwargs)
        self.validate_dflash()

    def validate_dflash(self) -> None:
        block_size = self.block_size
        if not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"dflash_config.block_size must be an integer >= 2, got {block_size!r}")
        layer_ids = self.target_layer_ids
        if not layer_ids or any(not isinstance(i, int) or i < 0 for i in layer_ids):
            raise ValueError(f"dflash_config.target_layer_ids must be non-negative integers, got {layer_ids!r}")
        if self.num_target_layers is not None and max(layer_ids) >= self.num_target_layers:
            raise ValueError(
                f"dflash_config.target_layer_ids {layer_ids} reach layer {max(layer_ids)}, but num_target_layers "
                f"is {self.num_target_layers} (each id must be < num_target_layers)"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"dflash_config.mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")
        if self.use_conv:
            group = self.dflash_config.get("conv_group_size", 16)
            if self.hidden_size % group:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by conv_group_size {group}")
        if self.use_selector and not 1 <= self.selector_top_k <= self.vocab_size:
            raise ValueError(f"selector_top_k {self.selector_top_k} must be in [1, vocab_size={self.vocab_size}]")

    # Read-only views of dflash_config, so the model code reads like the paper.
    @property
    def block_size(self) -> int:
        return self.dflash_config["block_size"]

    @property
    def mask_token_id(self) -> int:
        return self.dflash_config["mask_token_id"]

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_config["target_layer_ids"])

    @property
    def use_conv(self) -> bool:
        return int(self.dflash_config.get("conv_kernel_size") or 0) > 0

    @property
    def use_selector(self) -> bool:
        return int(self.dflash_config.get("selector_rank") or 0) > 0

    @property
    def conv_kernel_size(self) -> int:
        return int(self.dflash_config.get("conv_kernel_size") or 0)

    @property
    def conv_group_size(self) -> int:
        return int(self.dflash_config.get("conv_group_size", 16))

    @property
    def selector_rank(self) -> int:
        return int(self.dflash_config.get("selector_rank") or 0)

    @property
    def selector_top_k(self) -> int:
        return int(self.dflash_config.get("selector_top_k", 16))

    @property
    def output_multiplier(self) -> float | None:
        return self.dflash_config.get("output_multiplier")

    @property
    def final_logit_softcapping(self) -> float | None:
        return self.dflash_config.get("final_logit_softcapping")

    @property
    def input_embedding_scale(self) -> float:
        return float(self.dflash_config.get("input_embedding_scale") or 1.0)

    @property
    def sandwich_norms(self) -> bool:
        return bool(self.dflash_config.get("sandwich_norms", False))

    @property
    def architecture_name(self) -> str:
        return "DFlash2DraftModel" if (self.use_conv or self.use_selector) else "DFlashDraftModel"

    @classmethod
    def for_target(
        cls,
        target_config,
        num_hidden_layers: int = 2,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        dflash2: bool = True,
        selector_rank: int = DFLASH2_DEFAULTS["selector_rank"],
        selector_top_k: int = DFLASH2_DEFAULTS["selector_top_k"],
        conv_kernel_size: int = DFLASH2_DEFAULTS["conv_kernel_size"],
        conv_group_size: int = DFLASH2_DEFAULTS["conv_group_size"],
        sliding_window: int | None = None,
        sandwich_norms: bool | None = None,
        **overrides: Any,
    ) -> "DFlash2Config":
        """A new head's config for any Hugging Face causal-LM config.

        Hidden size, heads, head dim, MLP width, vocab, RoPE and norm eps come from the target; the
        tapped layers default to evenly spaced ids from 1 to L-3 (L//2 for a single draft layer).
        ``mask_token_id`` defaults to the target's pad token, else its last vocabulary id.
        ``dflash2=False`` gives a DFlash 1 head (no conv, no selector). The MLP's activation is the target's,
        and ``sandwich_norms`` defaults to whether the target is a Gemma (its layers norm each sublayer's
        output), so that a head layer computes what a target layer does and can start as a copy of one.
        """
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        num_target_layers = text.num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_hidden_layers)
        if mask_token_id is None:
            pad = getattr(text, "pad_token_id", None)
            mask_token_id = pad if isinstance(pad, int) and pad >= 0 else text.vocab_size - 1
        dflash = {"block_size": block_size, "mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)}
        if dflash2:
            dflash.update(
                conv_kernel_size=conv_kernel_size,
                conv_group_size=conv_group_size,
                selector_rank=selector_rank,
                selector_top_k=selector_top_k,
            )
        if sandwich_norms is None:
            sandwich_norms = _is_gemma(text)
        if sandwich_norms:
            dflash["sandwich_norms"] = True
        embed_scale = _embedding_scale(text)
        if embed_scale != 1.0:
            dflash["input_embedding_scale"] = embed_scale
        softcap = getattr(text, "final_logit_softcapping", None)
        if softcap:
            dflash["final_logit_softcapping"] = softcap
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        rope = getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(text, "rope_theta", 10000.0)}
        fields = dict(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            hidden_act=getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu",
            max_position_embeddings=text.max_position_embeddings,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_parameters=dict(rope),
            use_sliding_window=sliding_window is not None,
            sliding_window=sliding_window,
            max_window_layers=num_hidden_layers,
            layer_types=["sliding_attention" if sliding_window else "full_attention"] * num_hidden_layers,
            tie_word_embeddings=False,
            use_cache=False,
            num_target_layers=num_target_layers,
            dflash_config=dflash,
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None),
            pad_token_id=getattr(text, "pad_token_id", None),
        )
        fields.update(overrides)
        return cls(**fields)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced from layer 1 to L-3 (the DFlash recipe); one draft layer taps L//2. On a target too
    shallow for that many distinct layers, each layer is tapped once (fewer taps, not repeated ones)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, max(1, num_target_layers - 3)
    span = end - start
    return sorted({start + round(i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)})


def _is_gemma(text_config) -> bool:
    return (getattr(text_config, "model_type", "") or "").startswith("gemma")


def _embedding_scale(text_config) -> float:
    """Gemma-style targets multiply embeddings by sqrt(hidden); the drafter must see the same input."""
    return float(text_config.hidden_size) ** 0.5 if _is_gemma(text_config) else 1.0


DFlash2Config.register_for_auto_class()  # every save writes auto_map["AutoConfig"] and this file

__all__ = ["DFlash2Config", "default_target_layer_ids"]
