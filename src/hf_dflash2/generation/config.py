"""The settings a call decodes with, resolved as ``target.generate`` resolves them, and the checks on its inputs.

Which ``GenerationConfig`` fields the loop applies, which it refuses by name (``UNSUPPORTED_GENERATION_SETTINGS``),
which it applies through the target's logits processors (``PROCESSED_SETTINGS``, ``processors.py``) and which
through the sampler (``TAIL_WARPERS``, ``sampling.py``); the new-token budget; EOS and pad ids; the checks that
raise a clear ``ValueError`` before any forward pass.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig

# When neither the call, its generation config nor the target's sets a length (Transformers would stop at
# max_length = 20 tokens in all, prompt included).
DEFAULT_MAX_NEW_TOKENS = 64

# A keyword argument the caller did not give; an explicit None overrides, as in ``target.generate``.
UNSET = object()

# Transformers' values for the sampling settings no config sets (GenerationConfig._get_default_generation_params).
TRANSFORMERS_SAMPLING_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}

# Generation settings the fast loop does not apply, with the value that turns each off. Each changes which
# tokens the target would emit (or what generate returns), so a call in which one would act is refused rather
# than silently decoding another law; ``generate(assistant_model=drafter)`` applies every logits processor,
# since Transformers verifies there. Those in SAMPLING_ONLY act only when sampling, as in ``generate``.
UNSUPPORTED_GENERATION_SETTINGS = {
    "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None, "guidance_scale": None,
    "watermarking_config": None, "dola_layers": None, "top_h": None, "output_attentions": False,
    "output_hidden_states": False,
}
SAMPLING_ONLY = ("top_h",)
# What generate returns these only with return_dict_in_generate (the target's per-token attentions and hidden
# states; a verify forward holds them for drafts that were rejected too, and the cache has holes at batch > 1).
DICT_ONLY = ("output_attentions", "output_hidden_states")

# What the call returns, and how many samples per prompt (``num_return_sequences``: rows repeated, as generate
# expands them; sampling only, as generate). ``SpeculativeOutput.scores`` / ``.logits`` with
# return_dict_in_generate: the values that chose each generated token, as generate's (``TokenScores``).
RETURN_SETTINGS = {"num_return_sequences": 1, "return_dict_in_generate": False, "output_scores": False,
                   "output_logits": False}

# Settings ``generate`` applies through logits processors that read the text so far. The fast loop runs
# Transformers' own processors at every verified slot on that slot's prefix (``TargetLogitsProcessors``);
# the values are the ones that turn each off.
PROCESSED_SETTINGS = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None, "min_length": 0,
    "min_new_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "remove_invalid_values": False, "renormalize_logits": False,
}
# Sampling warpers that come after top-p in generate's order and read only the scores: applied batched,
# after temperature / top-k / top-p (``Sampler``).
TAIL_WARPERS = {"min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}

# Plain greedy decoding whatever the target's generation_config asks (sampling, a repetition penalty):
# what the trainer's evaluation and held-out tau measure a head on.
PLAIN_GREEDY = {"do_sample": False, "max_time": None, **UNSUPPORTED_GENERATION_SETTINGS, **PROCESSED_SETTINGS,
                **TAIL_WARPERS, **RETURN_SETTINGS}


def _generate_would_apply(name: str, value, config: GenerationConfig) -> bool:
    """Whether ``generate`` would apply this setting's value (its processors' own conditions)."""
    off = UNSUPPORTED_GENERATION_SETTINGS[name]
    if value is None or value == off or (off is None and not value):
        return False
    if name in SAMPLING_ONLY and not config.do_sample:
        return False
    if name in DICT_ONLY and not config.return_dict_in_generate:
        return False
    if name == "guidance_scale":
        return value != 1
    return True


def resolve_generation_config(target, generation_config: GenerationConfig | None = None,
                              **overrides) -> GenerationConfig:
    """The settings a ``speculative_generate`` call decodes with, by ``target.generate``'s precedence: the
    call's keyword arguments (``UNSET`` = not given; an explicit ``None`` overrides), then
    ``generation_config``, then ``target.generation_config``, then Transformers' defaults (greedy; when
    sampling: temperature 1, top-k 50, top-p 1), so that a call samples the law ``target.generate`` would.
    Raises ``ValueError`` naming the setting and where it came from, for unknown options and for settings the
    fast loop does not apply (``UNSUPPORTED_GENERATION_SETTINGS``) where ``generate`` would apply them."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError("generation_config must be a transformers.GenerationConfig, "
                         f"got {type(generation_config).__name__}")
    given = {name: value for name, value in overrides.items() if value is not UNSET}
    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    config.update(defaults_only=True, **target.generation_config.to_dict())
    config.update(defaults_only=True, **TRANSFORMERS_SAMPLING_DEFAULTS)
    unknown = config.update(**given)
    if unknown:
        raise ValueError(f"speculative_generate got unknown generation options {sorted(unknown)}: its model inputs "
                         "are input_ids and attention_mask (drop other tokenizer outputs, e.g. "
                         "return_token_type_ids=False), its options GenerationConfig fields")
    for name in UNSUPPORTED_GENERATION_SETTINGS:
        value = getattr(config, name, None)
        if not _generate_would_apply(name, value, config):
            continue
        if name in given:
            origin = "the call"
        elif generation_config is not None and getattr(generation_config, name, None) is not None:
            origin = "generation_config"
        else:
            origin = "the target's generation_config"
        raise ValueError(
            f"{name}={value!r} (from {origin}) is not applied by speculative_generate, so its output would not "
            f"be the target's; pass {name}={UNSUPPORTED_GENERATION_SETTINGS[name]!r} to decode without it, or "
            "use target.generate(**inputs, assistant_model=drafter), which applies every logits processor"
        )
    return config


def new_token_budget(config: GenerationConfig, prompt_length: int, context: int | None, block_size: int) -> int:
    """``max_new_tokens``, else ``max_length`` minus the prompt (capped so that a round's block still fits
    the context: some checkpoints set max_length to the context itself), else ``DEFAULT_MAX_NEW_TOKENS``."""
    if config.max_new_tokens is not None:
        return config.max_new_tokens
    if config.max_length is not None:
        budget = config.max_length - prompt_length
        if context is not None:
            budget = min(budget, context - prompt_length - block_size)
        if budget <= 0:
            raise ValueError(f"max_length {config.max_length} leaves no room after the prompt of {prompt_length} "
                             "tokens; set max_new_tokens instead")
        return budget
    return DEFAULT_MAX_NEW_TOKENS


def eos_tensor(eos_token_id, device) -> torch.Tensor:
    if eos_token_id is None:
        return torch.empty(0, dtype=torch.long, device=device)
    if isinstance(eos_token_id, torch.Tensor):
        return eos_token_id.flatten().to(device=device, dtype=torch.long)
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    return torch.tensor(ids, dtype=torch.long, device=device)


def pad_id(config) -> int | None:
    """The config's pad token as one id (a list's first), or None."""
    pad = config.pad_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    return None if pad is None else int(pad)


def check_input_ids(input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = getattr(input_ids, "shape", type(input_ids))
        raise ValueError(f"input_ids must be a 2-D LongTensor [batch, length], got {got}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids (a LongTensor), got dtype {input_ids.dtype}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): a prompt needs at least one token")


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Every prompt column, padding included (the prefill embeds it too), is an id of the target's vocabulary:
    an id outside it would fail inside the first forward (on CUDA as a device-side assert), after the setup."""
    outside = (input_ids < 0) | (input_ids >= vocab_size)
    if bool(outside.any()):
        row, column = (int(i) for i in outside.nonzero()[0])
        raise ValueError(f"input_ids[{row}, {column}] = {int(input_ids[row, column])} is not a token id of the "
                         f"target's vocabulary of {vocab_size}")


def check_sampling(top_k, top_p) -> None:
    """``generate``'s ranges for the sampling filters: top_k an integer >= 0 (0: off), top_p in [0, 1] (0 keeps
    only the likeliest token, 1: off); None: off."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 or None: no top-k filter), got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0.0 <= top_p <= 1.0):
        raise ValueError(f"top_p must be a number in [0, 1] (1 or None: no top-p filter), got {top_p!r}")


def mask_from_padding(input_ids: torch.Tensor, config) -> torch.Tensor | None:
    """``generate``'s inference when no attention mask is given, for left padding: where a row starts with
    the pad token (and it is not an EOS id), those leading positions are padding. A pad id after a row's
    first other token stays text: ``generate`` would mask it too, leaving a hole the loop's positions (left
    padding) do not model, and a real prompt may hold that id. -> [N, L] long, or None (all text)."""
    pad = pad_id(config)
    if pad is None or pad in eos_tensor(config.eos_token_id, "cpu").tolist():
        return None
    leading = (input_ids == pad).long().cumprod(dim=1).bool()
    return (~leading).long() if bool(leading.any()) else None


def check_max_new_tokens(max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")


def validate_generation_inputs(target, drafter, input_ids, attention_mask, max_new_tokens, block_size) -> None:
    """Raise a clear ``ValueError`` before any forward pass."""
    check_input_ids(input_ids)
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        empty_rows = (attention_mask.sum(-1) == 0).nonzero().flatten().tolist()
        if empty_rows:
            raise ValueError(f"rows {empty_rows} of the batch have an empty prompt (attention_mask all zero)")
        right_padded = (attention_mask[:, -1] == 0).nonzero().flatten().tolist()
        if right_padded:
            raise ValueError(f"rows {right_padded} of the batch end in padding: speculative_generate continues each "
                             "row after its last column, so pad on the left (tokenizer.padding_side = 'left')")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 2 <= block_size:
        raise ValueError(f"block_size must be an integer >= 2, got {block_size!r}")
    embedding = target.get_input_embeddings()
    rows = getattr(getattr(embedding, "weight", None), "shape", (None,))[0]
    vocab_size = rows or getattr(target.config.get_text_config(), "vocab_size", None)
    if vocab_size:
        check_token_ids(input_ids, vocab_size)
    limit = target.config.get_text_config().max_position_embeddings
    needed = input_ids.shape[1] + max_new_tokens + block_size
    if limit is not None and needed > limit:
        raise ValueError(
            f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} + block_size {block_size} "
            f"= {needed} "
            f"exceeds the target's context of {limit} positions"
        )
