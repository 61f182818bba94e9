"""Tiny random targets and drafters built in-process (no network, seconds on a CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"  # copies of shared/reference/fixtures


def tiny_target(arch: str = "llama", vocab_size: int = 96, hidden_size: int = 64, layers: int = 6, seed: int = 0, **overrides):
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    common.update(overrides)
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": hidden_size // 4}),
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"head_dim": hidden_size // 4, "sliding_window": 64}),
    }
    config_cls, model_cls, extra = classes[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**extra, **common})).eval()
    model.generation_config.eos_token_id = common["eos_token_id"]
    model.generation_config.pad_token_id = common["pad_token_id"]
    return model


def tiny_drafter(target, dflash2: bool = True, block_size: int = 4, layers: int = 2, seed: int = 1, randomize: bool = True, **kwargs):
    """A head for ``target``; ``randomize`` perturbs the identity-initialised conv and selector so
    tests exercise them (a fresh head has them as no-ops)."""
    from hf_dflash2 import DFlash2DraftModel

    kwargs.setdefault("selector_rank", 16)
    kwargs.setdefault("selector_top_k", 4)
    kwargs.setdefault("mask_token_id", 1)
    drafter = DFlash2DraftModel.for_target(target, num_hidden_layers=layers, block_size=block_size, dflash2=dflash2, seed=seed, **kwargs)
    if randomize and dflash2:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in drafter.named_parameters():
                if "conv" in name or "successor_codebook" in name:
                    param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    return drafter.eval().bind_target(target)


@pytest.fixture
def llama_target():
    return tiny_target("llama")


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield


# Tests in other files that take well over ~15 s on 2 cores (subprocesses, the real model, 20,000-run
# statistics); marked here so that `make test-fast` (-m "not slow") skips them without touching their files.
SLOW_TESTS = {
    "test_fast_loop_sampling_is_lossless",
    "test_generate_path_sampling_is_lossless",
    "test_kill_9_mid_run_loses_at_most_the_last_steps",
    "test_two_process_ddp_matches_one_process_same_global_batch",
    "test_loss_decreases_and_accuracy_rises",
    "test_real_model_greedy_identity_both_paths",
    "test_real_model_batched_rows_equal_single",
    "test_push_then_load_from_the_hub_and_generate",
    "test_remote_code_loads_without_the_package_bit_exact",
    "test_sampling_with_processors_and_min_p_keeps_generates_law",
    "test_sampled_tree_rounds_with_processors_keep_generates_law",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if getattr(item, "originalname", item.name) in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
