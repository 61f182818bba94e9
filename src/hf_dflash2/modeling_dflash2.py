"""dFlash 2 drafter: a few Qwen3-style layers that draft a whole block in one forward pass.

Reading order: RMSNorm and RoPE helpers -> ``DFlash2Conv`` (two-tap dynamic conv) -> attention with
context-KV injection -> decoder layer -> ``DFlash2CandidateSelector`` (K x K path selector) ->
``DFlash2DraftModel``.

Shapes: ``N`` batch rows, ``n`` blocks per row (1 at inference, many in training), ``B`` block size,
``S = B - 1`` drafted positions, ``T`` context slots, ``H`` hidden size, ``K`` selector top-k, ``V`` vocab.

The drafter owns no embedding and no LM head: ``bind_target`` attaches the target's (frozen, not saved).
This file and its siblings import each other only as ``from .x import y`` so that ``save_pretrained``
ships them as remote code.
"""

from __future__ import annotations

import inspect
import os
import shutil
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import logging

from .candidate_generator_dflash2 import candidate_generator_for, install_generate_hook
from .configuration_dflash2 import DFlash2Config
from .custom_generate_dflash2 import generate as custom_generate_entry
from .head_files_dflash2 import (
    DRAFT_VOCAB_FILE,
    HeadFileError,
    check_head_config,
    check_safetensors_complete,
    head_file,
    read_draft_vocab,
    safetensors_files,
    write_architectures,
    write_draft_vocab,
)

install_generate_hook()

CUSTOM_GENERATE_FILE = os.path.join("custom_generate", "generate.py")


class DFlash2RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class DFlash2RotaryEmbedding(nn.Module):
    """RoPE at arbitrary absolute positions (the block sits after the context, rows can differ).

    The inverse frequencies are recomputed from the config rather than kept in a buffer: a
    non-persistent buffer is left uninitialised when ``from_pretrained`` builds the model on ``meta``.
    """

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.config = config
        self._cached = None  # (inv_freq, attention_scaling), built on first use

    def _frequencies(self) -> tuple[torch.Tensor, float]:
        if self._cached is None:
            rope = dict(self.config.rope_parameters or {})
            rope_type = rope.get("rope_type", "default")
            if rope_type == "default":
                base, dim = rope.get("rope_theta", 10000.0), self.config.head_dim
                inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
                self._cached = (inv_freq, 1.0)
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, torch.device("cpu"))
                self._cached = (inv_freq.float(), float(scaling))
        return self._cached

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [N, L] -> cos, sin: [N, 1, L, head_dim]"""
        inv_freq, scaling = self._frequencies()
        if inv_freq.device != positions.device:  # once per device, not a host-to-device copy per call
            inv_freq = inv_freq.to(positions.device)
            self._cached = (inv_freq, scaling)
        freqs = positions.float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype)[:, None], (emb.sin() * scaling).to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class DFlash2Conv(nn.Module):
    """Grouped dynamic depthwise causal conv with ``taps`` taps, local to each block.

    ``out[i, c] = sum_t (base[side, t, c] + delta[i, side, t, c // group]) * x[i - t, c]`` with
    ``x[i - t] = 0`` before the block start. ``delta`` comes from the normed sub-layer input through
    ``kernel_projection`` and serves both sides (``side`` 0 wraps the sub-layer's input, 1 its output).
    Identity init: ``base[:, 0] = 1``, other taps and ``kernel_projection`` zero.
    """

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.taps = config.conv_kernel_size
        self.group_size = config.conv_group_size
        hidden = config.hidden_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * self.taps * hidden // self.group_size, bias=False)
        self.kernel_projection._dflash_zero_init = True  # identity conv: read by _init_weights
        self.reset_to_identity()

    def extra_repr(self) -> str:
        return f"taps={self.taps}, group_size={self.group_size}, base_kernel={tuple(self.base_kernel.shape)}"

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def kernels(self, normed_input: torch.Tensor) -> torch.Tensor:
        """normed_input: [N, n, B, H] -> kernels [N, n, B, 2, taps, H]"""
        delta = self.kernel_projection(normed_input)
        delta = delta.unflatten(-1, (2, self.taps, -1)).repeat_interleave(self.group_size, dim=-1)
        return self.base_kernel.to(delta.dtype) + delta

    def forward(self, x: torch.Tensor, kernels: torch.Tensor, side: int) -> torch.Tensor:
        """x: [N, n, B, H] -> [N, n, B, H]; taps reach back inside the block only."""
        k = kernels[..., side, :, :]
        out = k[..., 0, :] * x
        for tap in range(1, self.taps):
            shifted = F.pad(x, (0, 0, tap, 0))[..., : x.shape[-2], :]
            out = out + k[..., tap, :] * shifted
        return out


class DFlash2MLP(nn.Module):
    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]  # the target's gate activation: SiLU, or Gemma's tanh GELU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DFlash2Attention(nn.Module):
    """Block queries attend to [context K/V (from target features), block K/V] in one SDPA call."""

    def __init__(self, config: DFlash2Config, layer_idx: int):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlash2RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DFlash2RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, L, H] -> k, v: [N, kv_heads, L, head_dim] (k normed and rotated)"""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))).transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(k, *rope), v

    def forward(
        self,
        x: torch.Tensor,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_kv: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """x: [N, Q, H] block tokens; context_kv: ([N, kv, T, d], same); mask: [N, 1, Q, T + Q] bool."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))).transpose(1, 2)
        q = apply_rope(q, *block_rope)
        k_block, v_block = self.project_kv(x, block_rope)
        k = torch.cat([context_kv[0].to(k_block.dtype), k_block], dim=2)
        v = torch.cat([context_kv[1].to(v_block.dtype), v_block], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, scale=self.scaling, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class DFlash2DecoderLayer(GradientCheckpointingLayer):
    """norm -> conv(in) -> attention -> conv(out) -> +residual, then the same around the MLP.

    With ``dflash_config.sandwich_norms`` (heads for Gemma targets) each sublayer's output is normed too
    before the residual add, under Gemma's names: ``post_attention_layernorm`` then norms the attention's
    output, and ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` surround the MLP. A head layer
    then computes what a Gemma decoder layer computes, so it can start as a copy of one."""

    def __init__(self, config: DFlash2Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlash2Attention(config, layer_idx)
        self.mlp = DFlash2MLP(config)
        self.input_layernorm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.post_feedforward_layernorm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.sandwich_norms = config.sandwich_norms
        self.is_sliding = (config.layer_types or ["full_attention"] * (layer_idx + 1))[layer_idx] == "sliding_attention"
        if config.use_conv:
            self.attention_conv = DFlash2Conv(config)
            self.mlp_conv = DFlash2Conv(config)
        else:
            self.attention_conv = self.mlp_conv = None

    def _sublayer(self, x, norm, conv, fn, output_norm=None):
        """x: [N, n, B, H]"""
        h = norm(x)
        if conv is None:
            h = fn(h)
        else:
            kernels = conv.kernels(h)
            h = conv(fn(conv(h, kernels, side=0)), kernels, side=1)
        return x + (h if output_norm is None else output_norm(h))

    def forward(self, x, rope_cos, rope_sin, context_k, context_v, attention_mask):
        """x: [N, n, B, H] -> [N, n, B, H]. Every tensor is its own positional argument, so that gradient
        checkpointing (reentrant too) carries gradients back into the context keys and values, i.e. to ``fc``."""
        shape = x.shape

        def attend(h):
            return self.self_attn(h.flatten(1, 2), (rope_cos, rope_sin), (context_k, context_v),
                                  attention_mask).view(shape)

        if self.sandwich_norms:
            x = self._sublayer(x, self.input_layernorm, self.attention_conv, attend, self.post_attention_layernorm)
            return self._sublayer(x, self.pre_feedforward_layernorm, self.mlp_conv, self.mlp,
                                  self.post_feedforward_layernorm)
        x = self._sublayer(x, self.input_layernorm, self.attention_conv, attend)
        return self._sublayer(x, self.post_attention_layernorm, self.mlp_conv, self.mlp)


@dataclass
class SelectorOutput:
    """Result of the path selector for ``S`` drafted positions.

    tokens: [N, S] chosen token ids; choice: [N, S] index of the chosen candidate;
    candidate_ids: [N, S, K]; q: [N, S, K] proposal distribution over each step's candidates
    (one-hot at temperature 0); tables: [N, S, K, K] pairwise scores (row = previous choice);
    unary: [N, S, K] the candidates' unary logits, largest first.
    """

    tokens: torch.Tensor
    choice: torch.Tensor
    candidate_ids: torch.Tensor
    q: torch.Tensor
    tables: torch.Tensor
    unary: torch.Tensor


class DFlash2CandidateSelector(nn.Module):
    """K x K "Markov" path selector over each position's top-K unary candidates.

    ``S_t(a, b) = U_t(b) + <A(a) * P(h_t), B(b)>``, with A = ``predecessor_codebook``, B =
    ``successor_codebook``, P = ``hidden_projection``. The predecessor of the first drafted position is the
    anchor token. B is zero-initialised, so a fresh selector picks the unary top-1.
    """

    def __init__(self, config: DFlash2Config):
        super().__init__()
        rank = config.selector_rank
        self.top_k = config.selector_top_k
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))

    def extra_repr(self) -> str:
        vocab, rank = self.predecessor_codebook.shape
        return f"top_k={self.top_k}, rank={rank}, codebooks=2 x ({vocab}, {rank})"

    def pair_tables(
        self, hidden: torch.Tensor, unary: torch.Tensor, candidate_ids: torch.Tensor, predecessor_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden: [..., S, H]; unary: [..., S, K] scores of the candidates; candidate_ids: [..., S, K];
        predecessor_ids: [..., S, K'] (K' = K, or 1 when teacher-forced) -> tables [..., S, K', K]."""
        pred = self.predecessor_codebook[predecessor_ids] * self.hidden_projection(hidden).unsqueeze(-2)
        succ = self.successor_codebook[candidate_ids]
        return unary.unsqueeze(-2) + pred.to(succ.dtype) @ succ.transpose(-1, -2)

    def forward(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        vocab: torch.Tensor | None = None,
    ) -> SelectorOutput:
        """hidden: [N, S, H]; logits: [N, S, V'] unary (``vocab`` [V'] maps them to token ids when V' < V);
        anchor_ids: [N]. Greedy walk at T=0, Gumbel-max over S/T at T>0."""
        n, s, _ = logits.shape
        unary, candidate_ids = logits.float().topk(self.top_k, dim=-1)
        if vocab is not None:
            candidate_ids = vocab[candidate_ids]
        previous = torch.cat([anchor_ids[:, None, None].expand(n, 1, self.top_k), candidate_ids[:, :-1]], dim=1)
        tables = self.pair_tables(hidden, unary, candidate_ids, previous).float()
        if temperature > 0:
            gumbel = -torch.empty_like(tables[:, :, 0]).exponential_(generator=generator).log()
        choice = torch.zeros(n, dtype=torch.long, device=logits.device)
        rows = torch.arange(n, device=logits.device)
        choices, qs = [], []
        for t in range(s):  # the walk is sequential in t, batched over rows; no host sync
            scores = tables[rows, t, choice]
            if temperature > 0:
                choice = (scores / temperature + gumbel[:, t]).argmax(-1)
                qs.append(torch.softmax(scores / temperature, dim=-1))
            else:
                choice = scores.argmax(-1)
                qs.append(F.one_hot(choice, self.top_k).to(scores.dtype))
            choices.append(choice)
        choice = torch.stack(choices, dim=1)
        tokens = candidate_ids.gather(-1, choice[..., None]).squeeze(-1)
        return SelectorOutput(tokens, choice, candidate_ids, torch.stack(qs, dim=1), tables, unary)


def _onednn_packed(weight: torch.Tensor, kernel: str | None):
    """``(x, bias) -> F.linear(x, weight, bias)`` through oneDNN with ``weight`` packed once, when the target's LM
    head runs on oneDNN (``kernel``) and this CPU can pack ``weight``; else None (``F.linear`` serves)."""
    if kernel != "onednn" or weight.device.type != "cpu" or not weight.is_floating_point():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)
    except (RuntimeError, AttributeError):  # no oneDNN in this build, or no bf16 packing on this CPU
        return None
    return lambda x, bias=None: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass
class BoundTarget:
    """The target's frozen input embedding and LM head, referenced (not owned) by the drafter; ``lm_head``
    is the target's LM head module itself, through which drafts over the full vocabulary run."""

    embed_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    lm_head_bias: torch.Tensor | None
    num_layers: int
    lm_head: nn.Module | None = None

    def __deepcopy__(self, memo) -> "BoundTarget":
        return self  # a copied drafter refers to the same target; copying its vocabulary matrices would not bind it


@dataclass
class DraftOutput:
    """tokens: [N, S] proposed tokens; q_ids/q_probs: [N, S, K] sparse proposal distribution (dense
    DFlash-1 sampling uses K = V); logits: [N, S, V] unary logits; hidden: [N, S, H]; confidence: [N, S]
    the drafter's own estimate that each draft is accepted given the earlier ones (see ``propose``);
    pair_scores: [N, S, K, K] the selector's scores of each candidate given the previous position's
    (dFlash 2; ranks the continuations a draft tree verifies); candidate_logits: [N, S, K] the selector's
    candidates' unary logits, largest first (dFlash 2)."""

    tokens: torch.Tensor
    q_ids: torch.Tensor | None
    q_probs: torch.Tensor | None
    logits: torch.Tensor
    hidden: torch.Tensor
    confidence: torch.Tensor | None = None
    pair_scores: torch.Tensor | None = None
    candidate_logits: torch.Tensor | None = None


def _placement(device) -> str:
    """A ``device_map`` value as one name per device: 0, "cuda:0" and torch.device("cuda", 0) are the same."""
    if isinstance(device, str) and device in ("cpu", "disk", "meta"):
        return device
    if isinstance(device, int):  # accelerate's index of a GPU
        return f"cuda:{device}"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        return str(device)
    return str(device) if device.index is not None or device.type == "cpu" else f"{device.type}:0"


class DFlash2PreTrainedModel(PreTrainedModel):
    config_class = DFlash2Config
    base_model_prefix = ""
    supports_gradient_checkpointing = True
    _no_split_modules = ["DFlash2DecoderLayer"]
    _supports_sdpa = True
    # what forward takes first: a head owns no embedding, so nothing asks for input-embedding gradients
    # (activation_checkpointing_enable would, for "input_ids", and warn that none exist)
    main_input_name = "block_embeds"

    def _check_and_adjust_attn_implementation(self, attn_implementation=None, *args, **kwargs) -> str:
        """The drafter's attention is its own SDPA call (a block over [context, block] keys with a sparse
        mask), whatever the target uses: a request for another implementation (users load every model with
        ``attn_implementation="flash_attention_2"``) is read as SDPA, with a warning, instead of refused."""
        if attn_implementation not in (None, "sdpa"):
            logging.get_logger(__name__).warning_once(
                f"DFlash2DraftModel: attn_implementation={attn_implementation!r} is read as 'sdpa' (the drafter "
                "runs its own SDPA attention over context and block)")
        return "sdpa"

    def get_correct_attn_implementation(self, requested_attention=None, *args, **kwargs) -> str:
        return self._check_and_adjust_attn_implementation(requested_attention)  # Transformers calling it directly

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            if getattr(module, "_dflash_zero_init", False):
                module.weight.zero_()
            else:
                module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, DFlash2RMSNorm):
            module.weight.fill_(1.0)
        if isinstance(module, DFlash2Conv):
            module.reset_to_identity()
        elif isinstance(module, DFlash2CandidateSelector):
            module.hidden_projection.weight.normal_(0.0, std)
            module.predecessor_codebook.normal_(0.0, std)
            module.successor_codebook.zero_()


class DFlash2DraftModel(DFlash2PreTrainedModel):
    """A dFlash 2 (or, with conv and selector off in the config, DFlash 1) drafter head.

    Typical use::

        drafter = DFlash2DraftModel.from_pretrained(head_dir).bind_target(target)
        target.generate(**inputs, assistant_model=drafter)
    """

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        taps = len(config.target_layer_ids)
        self.fc = nn.Linear(taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlash2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlash2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.candidate_selector = DFlash2CandidateSelector(config) if config.use_selector else None
        self.rotary_emb = DFlash2RotaryEmbedding(config)
        self.post_init()

    @classmethod
    def for_target(cls, target, num_hidden_layers: int = 2, block_size: int = 16, dflash2: bool = True,
                   seed: int | None = 0, output_scale: float = 1.0, **config_kwargs) -> "DFlash2DraftModel":
        """A fresh head for ``target`` (any Hugging Face causal LM), in its dtype and on its device, unbound.

        The config comes from ``DFlash2Config.for_target(target.config, ...)`` (``config_kwargs`` go there).
        The output norm starts at the target's final-norm scale, read off the module itself so that offset
        conventions (Gemma's ``1 + w``) come out right, times ``output_scale``. A head to be trained from
        scratch wants it damped (``train`` and ``distill`` use 0.1, recorded as ``TrainingConfig.output_scale``):
        logits that can span only a fraction of the target's train more stably. Not far below that, though:
        near-uniform first predictions take many steps to grow back.
        Same seed -> same weights, and the caller's random streams (CPU and accelerator) are left as they were;
        ``seed=None`` draws from the caller's stream.
        """
        if not 0 < output_scale <= 1:
            raise ValueError(f"output_scale must be in (0, 1], got {output_scale}")
        config = DFlash2Config.for_target(target.config, num_hidden_layers=num_hidden_layers, block_size=block_size,
                                          dflash2=dflash2, **config_kwargs)
        embed = target.get_input_embeddings().weight
        if seed is None:  # drawn from (and advancing) the caller's stream, as any module built with torch
            drafter = cls(config)
        else:  # the weights are drawn on the CPU, from a seeded copy of its generator; the caller's streams stay
            with torch.random.fork_rng(devices=[]), torch.device("cpu"):
                torch.default_generator.manual_seed(seed)
                drafter = cls(config)
        drafter = drafter.to(device=embed.device, dtype=embed.dtype)
        with torch.no_grad():
            drafter.norm.weight.copy_(target_output_scale(target, config.hidden_size) * output_scale)
        return drafter

    # ------------------------------------------------------------------ binding to a target
    def bind_target(self, target) -> "DFlash2DraftModel":
        """Attach the target's embedding and LM head (frozen, not saved). Validates before any compute.

        ``target`` is any Hugging Face causal LM. Raises ``ValueError`` naming both values on a mismatch of
        hidden size, vocab size, layer count, tapped layer ids, mask token id, dtype or device, and on a target
        split over several devices (``device_map="auto"`` on a multi-GPU machine), which the loops do not support.
        """
        text = target.config.get_text_config()
        cfg = self.config
        checks = [
            ("hidden_size", cfg.hidden_size, text.hidden_size),
            ("vocab_size", cfg.vocab_size, text.vocab_size),
        ]
        if cfg.num_target_layers is not None:
            checks.append(("num_target_layers", cfg.num_target_layers, text.num_hidden_layers))
        for name, mine, theirs in checks:
            if mine != theirs:
                raise ValueError(f"drafter {name}={mine} does not match the target's {name}={theirs}")
        if max(cfg.target_layer_ids) >= text.num_hidden_layers:
            raise ValueError(
                f"drafter target_layer_ids {cfg.target_layer_ids} include layer {max(cfg.target_layer_ids)}, "
                f"but the target has {text.num_hidden_layers} layers"
            )
        embed = target.get_input_embeddings()
        head = target.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError(f"target {type(target).__name__} has no input embedding or LM head to share")
        vocab_rows = embed.weight.shape[0]
        if not 0 <= cfg.mask_token_id < vocab_rows:
            raise ValueError(f"drafter mask_token_id={cfg.mask_token_id} is outside the target's vocabulary (size {vocab_rows})")
        # accelerate's CPU / disk offload runs those layers where the rest runs: only accelerators count
        placed = {_placement(device) for device in (getattr(target, "hf_device_map", None) or {}).values()}
        placed = sorted(placed - {"cpu", "disk"})
        if len(placed) > 1 or head.weight.device != embed.weight.device:
            devices = placed if len(placed) > 1 else [str(embed.weight.device), str(head.weight.device)]
            raise ValueError(f"the target is split over devices {devices} (device_map): both loops keep its tapped "
                             "states, logits and the drafter on one device; load the target on one "
                             '(device_map="cuda" or .to(device); CPU offload is fine)')
        mine = next(self.parameters())
        if mine.device != embed.weight.device:
            raise ValueError(f"drafter is on device {mine.device} but the target's embedding is on {embed.weight.device}")
        if mine.dtype != embed.weight.dtype:
            raise ValueError(f"drafter dtype {mine.dtype} does not match the target's dtype {embed.weight.dtype}")
        self.__dict__["_bound_target"] = BoundTarget(
            embed.weight, head.weight, getattr(head, "bias", None), text.num_hidden_layers, head
        )
        self.__dict__.pop("_draft_head", None)  # rows of the previous target's LM head
        return self

    def get_input_embeddings(self) -> None:
        """None: a head owns no embedding. It reads the bound target's (``bound_target.embed_weight``), and
        handing out the target's module would let tools meant for the head (``resize_token_embeddings``,
        input-grad hooks) change the target in place."""
        return None

    def resize_token_embeddings(self, *args, **kwargs):
        raise NotImplementedError("a dFlash 2 head reads the target's embedding: resize or replace it on the target, "
                                  "then bind_target(target) again")

    def get_output_embeddings(self) -> None:
        return None  # the target's LM head is read through bound_target, never owned or tied

    @property
    def bound_target(self) -> BoundTarget:
        bound = self.__dict__.get("_bound_target")
        if bound is None:
            raise RuntimeError("this drafter is not bound to a target: call drafter.bind_target(target) first")
        return bound

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw rows of the target's embedding table times ``input_embedding_scale`` (the heads' input)."""
        out = F.embedding(ids, self.bound_target.embed_weight)
        scale = self.config.input_embedding_scale
        return out * scale if scale != 1.0 else out

    def set_draft_vocab(self, token_ids) -> "DFlash2DraftModel":
        """Restrict drafting to these token ids (e.g. the tokens a head was trained on), or None for all.

        Proposals stay lossless (the target still verifies every token); the LM head shrinks to these rows,
        which on a CPU is most of a draft pass. Saved as ``draft_vocab.json`` beside the weights.
        """
        if token_ids is None:
            self.__dict__["_draft_vocab"] = None
            self.__dict__.pop("_draft_head", None)
            return self
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique(sorted=True)
        if ids.numel() == 0:
            raise ValueError("the draft vocabulary is empty")
        outside = ids[(ids < 0) | (ids >= self.config.vocab_size)]
        if outside.numel():
            raise ValueError(
                f"draft vocabulary ids must lie in [0, {self.config.vocab_size}); {outside.numel()} do not, "
                f"e.g. {outside[:5].tolist()}"
            )
        self.__dict__["_draft_vocab"] = ids
        self.__dict__.pop("_draft_head", None)
        return self

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        return self.__dict__.get("_draft_vocab")

    def _draft_head_rows(self, weight: torch.Tensor, bias: torch.Tensor | None, vocab: torch.Tensor, kernel: str | None):
        """The draft vocabulary's rows of the target's LM head (and bias), gathered once per state of its weight
        (the same tensor, dtype, device, storage and in-place version), and their oneDNN-packed matmul for
        ``kernel`` (None where it does not apply) -> (rows [V', H], bias or None, packed or None). The rows are
        detached: the target's LM head is frozen, and a cached tensor must not carry one call's graph."""
        state = (weight.dtype, weight.device, weight.data_ptr(), None if weight.is_inference() else weight._version)
        cached = self.__dict__.get("_draft_head")
        if cached is None or cached["weight"] is not weight or cached["state"] != state:
            with torch.inference_mode(False):  # a normal tensor, usable later with gradients on
                vocab = vocab.to(weight.device)
                self.__dict__["_draft_vocab"] = vocab
                cached = {"weight": weight, "state": state, "rows": weight.detach()[vocab].contiguous(),
                          "bias": None if bias is None else bias.detach()[vocab], "packed": {}}
            self.__dict__["_draft_head"] = cached
        if kernel not in cached["packed"]:  # per kernel: switching the target's kernel back and forth repacks nothing
            cached["packed"][kernel] = _onednn_packed(cached["rows"], kernel)
        return cached["rows"], cached["bias"], cached["packed"][kernel]

    def unary_logits(self, hidden: torch.Tensor, restrict: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden: [..., H] final-normed -> (logits [..., V'], vocab ids [V'] or None when V' = V)."""
        bound = self.bound_target
        weight, bias, vocab = bound.lm_head_weight, bound.lm_head_bias, self.draft_vocab if restrict else None
        packed = None
        if vocab is not None:
            # the kernel the target's LM head runs on (``hf_dflash2.cpu.linear_kernels`` tags a packed forward)
            kernel = getattr(bound.lm_head.__dict__.get("forward"), "kernel", None) if bound.lm_head is not None else None
            weight, bias, packed = self._draft_head_rows(weight, bias, vocab, kernel)
        # As a 2-D matmul: F.linear on a non-contiguous 3-D input (the block minus its anchor) falls back to a
        # batched matmul that copies the whole LM head weight on every call, most of a CPU draft pass.
        flat = hidden.to(weight.dtype).reshape(-1, hidden.shape[-1])
        inference = not torch.is_grad_enabled() and weight.is_floating_point()  # a quantized head: its own path
        if vocab is None and bound.lm_head is not None and inference:
            # Drafting over the full vocabulary: the target's own module, so that a kernel its LM head runs on
            # (e.g. oneDNN with packed weights, ``hf_dflash2.cpu.linear_kernels``) serves the draft pass too.
            logits = bound.lm_head(flat)
        elif packed is not None and inference and flat.device.type == "cpu":
            logits = packed(flat, bias)  # the draft vocabulary's rows, packed like the target's LM head
        else:
            logits = F.linear(flat, weight, bias)
        logits = logits.view(*hidden.shape[:-1], weight.shape[0])
        return self.finish_logits(logits), vocab

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``output_multiplier`` then ``final_logit_softcapping`` (tanh(x / cap) * cap), when configured."""
        if self.config.output_multiplier is not None:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ------------------------------------------------------------------ backbone
    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """target_features: [N, T, taps * H] concatenated tapped layers -> [N, T, H]"""
        return self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """context: [N, T, H] projected; positions: [N, T] -> per layer (k, v): [N, kv, T, d]"""
        rope = self.rotary_emb(positions, context.dtype)
        return [layer.self_attn.project_kv(context, rope) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        attention_mask: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        context_features: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        sliding_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the backbone over blocks.

        block_embeds: [N, n, B, H]; block_positions: [N, n*B]; attention_mask: [N, 1, n*B, T + n*B] bool
        (True = visible). Context comes either as cached per-layer ``context_kv`` ([N, kv, T, d] each) or as
        raw ``context_features`` [N, T, taps*H] with their ``context_positions`` [N, T] (training).
        Returns final-normed hidden states [N, n, B, H].
        """
        if context_kv is None:
            context_kv = self.context_kv(self.project_context(context_features), context_positions)
        x = block_embeds.to(self.fc.weight.dtype)
        rope = self.rotary_emb(block_positions, x.dtype)
        for layer, kv in zip(self.layers, context_kv):
            mask = sliding_attention_mask if (layer.is_sliding and sliding_attention_mask is not None) else attention_mask
            x = layer(x, *rope, *kv, mask)
        return self.norm(x)

    @staticmethod
    def block_attention_mask(
        context_valid: torch.Tensor,
        context_positions: torch.Tensor,
        anchor_positions: torch.Tensor,
        block_size: int,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """The sparse block mask, for any number of blocks per row.

        context_valid: [N, T] bool; context_positions: [N, T]; anchor_positions: [N, n].
        A block sees context positions strictly before its anchor (and within the sliding window), and
        every token of its own block; never another block. -> [N, 1, n*B, T + n*B] bool.
        """
        n_blocks = anchor_positions.shape[1]
        anchors = anchor_positions[:, :, None]  # [N, n, 1]
        sees_context = context_valid[:, None, :] & (context_positions[:, None, :] < anchors)
        if sliding_window is not None:
            query_pos = anchors + block_size - 1  # the deepest query decides; window covers the block
            sees_context = sees_context & (query_pos - context_positions[:, None, :] < sliding_window)
        sees_context = sees_context.repeat_interleave(block_size, dim=1)  # [N, n*B, T]
        block_ids = torch.arange(n_blocks, device=anchor_positions.device).repeat_interleave(block_size)
        same_block = (block_ids[:, None] == block_ids[None, :]).expand(anchor_positions.shape[0], -1, -1)
        return torch.cat([sees_context, same_block], dim=-1)[:, None]

    # ------------------------------------------------------------------ drafting
    def draft_block(
        self,
        anchor_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        context_valid: torch.Tensor,
        context_positions: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        block_size: int | None = None,
        logits_processor=None,
    ) -> DraftOutput:
        """Draft ``B - 1`` tokens after each row's anchor in one forward pass.

        anchor_ids, anchor_positions: [N]; context_*: see ``block_attention_mask``. ``logits_processor``:
        a callable (unary logits [N, B - 1, V'], vocab ids [V'] or None) -> logits, applied before the
        selector, so that drafts follow what the target's decoding does to its own logits (a repetition
        penalty, banned words).
        """
        cfg = self.config
        block_size = block_size or cfg.block_size
        n = anchor_ids.shape[0]
        ids = torch.full((n, block_size), cfg.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        ids[:, 0] = anchor_ids
        positions = anchor_positions[:, None] + torch.arange(block_size, device=anchor_ids.device)
        mask = self.block_attention_mask(context_valid, context_positions, anchor_positions[:, None], block_size)
        sliding = None
        if cfg.sliding_window is not None and any(layer.is_sliding for layer in self.layers):
            sliding = self.block_attention_mask(
                context_valid, context_positions, anchor_positions[:, None], block_size, cfg.sliding_window
            )
        hidden = self(self.embed(ids)[:, None], positions, mask, context_kv=context_kv, sliding_attention_mask=sliding)[:, 0, 1:]
        logits, vocab = self.unary_logits(hidden)
        if logits_processor is not None:
            logits = logits_processor(logits, vocab)
        return self.propose(hidden, logits, anchor_ids, temperature, generator, vocab)

    def propose(self, hidden, logits, anchor_ids, temperature=0.0, generator=None, vocab=None) -> DraftOutput:
        """Turn unary logits into proposals: path selector (dFlash 2) or argmax / sampling (DFlash 1).

        ``vocab`` maps the last axis of ``logits`` to token ids when drafting over a sub-vocabulary.
        ``confidence`` is, greedy, the probability of each chosen token (the selector's softmax over its
        K candidates along the chosen path; DFlash 1: the unary max probability); when sampling, the unary
        max probability at ``temperature``, which does not depend on the sampled tokens, so a verify
        length chosen from it keeps sampling lossless."""
        if temperature > 0:
            confidence = torch.softmax(logits.float() / temperature, dim=-1).amax(-1)
        elif self.candidate_selector is None:
            confidence = torch.softmax(logits.float(), dim=-1).amax(-1)
        if self.candidate_selector is not None:
            sel = self.candidate_selector(hidden, logits, anchor_ids, temperature, generator, vocab)
            if temperature <= 0:
                previous = torch.cat([torch.zeros_like(sel.choice[:, :1]), sel.choice[:, :-1]], dim=1)
                rows = sel.tables.gather(2, previous[..., None, None].expand(-1, -1, 1, sel.tables.shape[-1]))
                confidence = rows.squeeze(2).softmax(-1).gather(-1, sel.choice[..., None]).squeeze(-1)
            return DraftOutput(sel.tokens, sel.candidate_ids, sel.q, logits, hidden, confidence, sel.tables,
                               sel.unary)
        ids = torch.arange(logits.shape[-1], device=logits.device) if vocab is None else vocab
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            local = torch.multinomial(probs.flatten(0, 1), 1, generator=generator).view(probs.shape[:2])
            return DraftOutput(ids[local], ids.expand_as(probs), probs, logits, hidden, confidence)
        tokens = ids[logits.argmax(-1)]
        ones = torch.ones_like(tokens[..., None], dtype=torch.float32)
        return DraftOutput(tokens, tokens[..., None], ones, logits, hidden, confidence)

    def get_candidate_generator(self, target, generation_config, logits_processor=None, model_kwargs=None, input_ids=None,
                                tokenizer=None, stopping_criteria=None):
        """Called by ``target.generate(assistant_model=self)`` (see ``candidate_generator_dflash2``);
        ``model_kwargs`` is part of the hook's signature and not needed here."""
        return candidate_generator_for(self, target, generation_config, logits_processor=logits_processor,
                                       input_ids=input_ids, tokenizer=tokenizer, stopping_criteria=stopping_criteria)

    # ------------------------------------------------------------------ saving
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """As ``PreTrainedModel.from_pretrained``; also reads the optional ``draft_vocab.json``.

        Raises ``HeadFileError`` naming the file for a ``config.json`` without the ``dflash_config`` fields,
        a truncated ``model.safetensors`` and a ``draft_vocab.json`` with ids outside the vocabulary.
        """
        hub_kwargs = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only", "subfolder")
                      if k in kwargs}
        if "config" not in kwargs:
            check_head_config(head_file(pretrained_model_name_or_path, "config.json", hub_kwargs))
        for weights in safetensors_files(pretrained_model_name_or_path, hub_kwargs):
            check_safetensors_complete(weights)
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, loading_info) on request
        path = head_file(pretrained_model_name_or_path, DRAFT_VOCAB_FILE, hub_kwargs)
        if path:
            try:
                model.set_draft_vocab(read_draft_vocab(path))
            except (ValueError, TypeError) as error:
                raise HeadFileError(f"{path}: not a valid draft vocabulary ({error})") from None
        return loaded

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs):
        """As ``PreTrainedModel.save_pretrained``, plus the published ``architectures`` name for DFlash 1 heads,
        the draft vocabulary and ``custom_generate/``. With ``push_to_hub=True`` the folder is completed first and
        then uploaded as it is (Transformers would upload inside its own save, before the files written here
        exist); ``repo_id``, ``commit_message``, ``commit_description``, ``create_pr``, ``private``, ``revision``
        and ``token`` are read as ``save_pretrained``'s."""
        hub_kwargs = {name: kwargs.pop(name) for name in ("repo_id", "commit_message", "commit_description",
                                                          "create_pr", "private", "revision") if name in kwargs}
        main_process = kwargs.get("is_main_process", args[0] if args else True)
        if hasattr(self, "should_save_on_this_rank"):  # Transformers' own rule (rank 0 under torch.distributed)
            main_process = self.should_save_on_this_rank(main_process)
        kwargs.setdefault("safe_serialization", True)
        self.config.architectures = [self.config.architecture_name]
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if not main_process:
            return result
        write_architectures(save_directory, [self.config.architecture_name])
        if self.draft_vocab is not None:
            write_draft_vocab(save_directory, self.draft_vocab.tolist())
        # Transformers' hook-free extension point: target.generate(custom_generate=<this folder>, ...)
        os.makedirs(os.path.join(save_directory, "custom_generate"), exist_ok=True)
        shutil.copyfile(inspect.getsourcefile(custom_generate_entry), os.path.join(save_directory, CUSTOM_GENERATE_FILE))
        if push_to_hub:  # the folder just written (its state_dict, shards and variant), as one commit
            from huggingface_hub import HfApi

            api = HfApi(token=kwargs.get("token"))
            repo_id = hub_kwargs.pop("repo_id", os.path.basename(os.path.normpath(os.fspath(save_directory))))
            repo_id = api.create_repo(repo_id, exist_ok=True, private=hub_kwargs.pop("private", None)).repo_id
            api.upload_folder(repo_id=repo_id, folder_path=save_directory,
                              commit_message=hub_kwargs.pop("commit_message", None) or "Upload dFlash 2 head",
                              **hub_kwargs)
        return result


def target_output_scale(target, hidden_size: int) -> torch.Tensor:
    """The per-channel scale of the target's final norm, [H]: its output for an all-ones input.

    Probing the module covers every convention (Llama's ``w``, Gemma's ``1 + w``); ones when the target
    has no recognisable final norm.
    """
    final_norm = getattr(getattr(target, "model", None), "norm", None)
    weight = getattr(final_norm, "weight", None)
    if final_norm is None or weight is None or weight.shape != (hidden_size,):
        return torch.ones(hidden_size)
    return applied_norm_scale(final_norm)


@torch.no_grad()
def applied_norm_scale(norm: nn.Module) -> torch.Tensor:
    """The per-channel scale an RMS norm module applies, [H] float32 on the CPU: its output for an all-ones
    input (whose RMS is 1, corrected for eps), so every convention comes out right (Llama's ``w``, Gemma's
    ``1 + w``)."""
    weight = norm.weight
    probe = torch.ones(1, weight.shape[0], dtype=weight.dtype, device=weight.device)
    rms_correction = (1.0 + getattr(norm, "eps", getattr(norm, "variance_epsilon", 0.0))) ** 0.5
    return norm(probe).float()[0].cpu() * rms_correction


class DFlashDraftModel(DFlash2DraftModel):
    """Name under which DFlash 1 heads are published; the same model with conv and selector off."""


# Every save_pretrained / push_to_hub writes ``auto_map`` and these code files, so heads load without the package.
DFlash2DraftModel.register_for_auto_class("AutoModel")


__all__ = ["DFlash2DraftModel", "DFlashDraftModel", "DFlash2PreTrainedModel", "DraftOutput", "HeadFileError", "SelectorOutput"]
