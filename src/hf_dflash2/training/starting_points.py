"""Where a head's training starts: its layers as copies of the target's (``copy_target_layers``), its context
projection as what a target layer reads (``copy_target_context``), calibrated query / key norms and output
scale, and a trained head grown by a layer, its selector pruned or its taps widened, each leaving what the
head computes unchanged until training moves it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..modeling_dflash2 import DFlash2DraftModel, applied_norm_scale

# The projections that write a decoder layer's two sublayers into the residual stream: zeroed, the layer
# adds nothing (the convolutions around them are linear in their input).
RESIDUAL_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def grown_drafter_weights(weights: dict[str, torch.Tensor], layers: int, grown_layers: int) -> dict[str, torch.Tensor]:
    """A drafter state dict of ``layers`` decoder layers grown to ``grown_layers``: each new layer copies the
    last one (its attention, MLP, norms and convolutions start trained, not random), with its residual
    outputs (``RESIDUAL_OUTPUTS``) zeroed, so the grown drafter's output equals the original's exactly;
    gradients reach the zeroed projections from the first step (their inputs are not zero)."""
    if not 0 < layers <= grown_layers:
        raise ValueError(f"cannot grow {layers} layers to {grown_layers}")
    last = f"layers.{layers - 1}."
    grown = dict(weights)
    for index in range(layers, grown_layers):
        for name, tensor in weights.items():
            if name.startswith(last):
                suffix = name[len(last):]
                copy = tensor.detach().clone()
                grown[f"layers.{index}.{suffix}"] = copy.zero_() if suffix in RESIDUAL_OUTPUTS else copy
    return grown


SELECTOR_FACTORS = ("candidate_selector.predecessor_codebook", "candidate_selector.hidden_projection.weight",
                    "candidate_selector.successor_codebook")


def pruned_selector_weights(weights: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """A drafter state dict whose path selector keeps its ``rank`` strongest coordinates. Coordinate r adds
    ``A[a, r] * P_r(h) * B[b, r]`` to every pair score (``DFlash2CandidateSelector``); its strength is the
    product of the norms of its three factors (A's column, P's row, B's column). A coordinate with a zero
    factor adds nothing, so pruning only such coordinates leaves the head's outputs unchanged. Why: the two
    ``[V, rank]`` codebooks are most of a head's bytes, and a smaller rank makes room for a layer."""
    predecessor, projection, successor = (weights[name] for name in SELECTOR_FACTORS)
    if not 0 < rank <= predecessor.shape[1]:
        raise ValueError(f"cannot prune a selector of rank {predecessor.shape[1]} to rank {rank}")
    strength = predecessor.float().norm(dim=0) * projection.float().norm(dim=1) * successor.float().norm(dim=0)
    keep = strength.topk(rank).indices.sort().values
    pruned = dict(weights)
    pruned[SELECTOR_FACTORS[0]] = predecessor[:, keep].clone()
    pruned[SELECTOR_FACTORS[1]] = projection[keep].clone()
    pruned[SELECTOR_FACTORS[2]] = successor[:, keep].clone()
    return pruned


def tap_columns(stored: list[int], used: list[int], hidden_size: int) -> torch.Tensor | None:
    """Feature columns of a store tapped at ``stored`` layers that a head tapping ``used`` reads, in the
    head's order (``tapped_features`` concatenates its taps so), or None when the two are the same. Why: one
    store serves heads that tap fewer of its layers, so arms that differ only in their taps see the same text."""
    if list(used) == list(stored):
        return None
    missing = [i for i in used if i not in stored]
    if missing:
        raise ValueError(f"the head taps layers {list(used)}, the store keeps only {list(stored)} (not {missing})")
    return torch.tensor([stored.index(i) * hidden_size + c for i in used for c in range(hidden_size)])


def widened_fc_weight(weight: torch.Tensor, source_taps: list[int], taps: list[int], hidden_size: int) -> torch.Tensor:
    """``fc.weight`` [H, len(source_taps) * H] of a head, laid out for a head that taps ``taps`` (a superset):
    each source tap's columns move to its place among ``taps`` and the new taps' columns are zero, so the
    widened head computes exactly what the source computed and training decides what the new layers add."""
    missing = [i for i in source_taps if i not in taps]
    if missing:
        raise ValueError(f"cannot widen taps {list(source_taps)} to {list(taps)}: {missing} would be dropped")
    widened = weight.new_zeros(weight.shape[0], len(taps) * hidden_size)
    columns = tap_columns(taps, source_taps, hidden_size)  # where each source column sits among the run's
    widened[:, slice(None) if columns is None else columns] = weight
    return widened


# Parameters a head layer has and a plain decoder layer of the target may lack: they keep their fresh values.
FRESH_LAYER_PARAMETERS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "attention_conv.", "mlp_conv.")


def _norm_scale(norm: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A target norm's per-channel scale as the head's norms apply it (``x * w``, ``applied_norm_scale``), which
    covers offset conventions (Gemma's ``1 + w``); the weight itself where the two agree."""
    scale = applied_norm_scale(norm)
    return weight if torch.allclose(scale, weight.float().cpu(), rtol=1e-2, atol=1e-4) else scale


def target_decoder_layers(target) -> torch.nn.ModuleList:
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"initializing from the target: {type(target).__name__} keeps no decoder layers in "
                         "get_decoder().layers")
    return layers


@torch.no_grad()
def copy_target_layers(drafter: DFlash2DraftModel, target, layer_ids: list[int]) -> list[str]:
    """Start head layer i as a copy of target decoder layer ``layer_ids[i]`` (attention projections, MLP,
    both norms): a head layer has a target layer's shapes, and a deep target layer already maps a residual
    stream to what the target's final norm and LM head read, which the head shares. Qwen3-style q/k norms
    and the conv stay fresh unless the target layer has them too. -> the names copied, per layer.

    Checked before anything is copied, each refusal a ``ValueError`` naming the value: one target layer per
    head layer, each within the target; the target's MLP activation is the head's (SiLU); every other
    head-layer parameter is in the target layer with the same shape; and the target layer has nothing the
    head would drop (Qwen2's attention biases, Gemma's extra norms), since the copy would not compute what
    the target layer computes. Norms are copied as the scale they apply (``_norm_scale``)."""
    text = target.config.get_text_config()
    layers = target_decoder_layers(target)
    if len(layer_ids) != len(drafter.layers):
        raise ValueError(f"init_layers_from_target={list(layer_ids)} names {len(layer_ids)} target layers, "
                         f"the head has {len(drafter.layers)}")
    for index in layer_ids:
        if not 0 <= index < len(layers):
            raise ValueError(f"init_layers_from_target: layer {index} is outside the target's {len(layers)} layers")
    activation = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None)
    if activation != drafter.config.hidden_act:
        raise ValueError(f"init_layers_from_target: the target's MLP activation is {activation!r}, the head's "
                         f"{drafter.config.hidden_act!r}")
    plan = []
    for head_layer, index in zip(drafter.layers, layer_ids):
        theirs = dict(layers[index].named_parameters())
        mine = dict(head_layer.named_parameters())
        dropped = sorted(set(theirs) - set(mine))
        if dropped:
            raise ValueError(f"init_layers_from_target: target layer {index} has {dropped}, which the head has no "
                             "place for")
        for name, parameter in mine.items():
            source = theirs.get(name)
            if source is not None and source.shape == parameter.shape:
                if name.endswith("norm.weight"):
                    source = _norm_scale(layers[index].get_submodule(name.rsplit(".", 1)[0]), source)
                plan.append((parameter, source, name))
            elif not name.startswith(FRESH_LAYER_PARAMETERS):
                found = "missing" if source is None else f"shape {tuple(source.shape)}"
                raise ValueError(f"init_layers_from_target: head parameter {name} {tuple(parameter.shape)} has no "
                                 f"counterpart in target layer {index} ({found})")
    for parameter, source, _ in plan:
        parameter.copy_(source.to(parameter.dtype))
    return sorted({name for _, _, name in plan})


def check_context_layer(drafter: DFlash2DraftModel, layers: torch.nn.ModuleList, layer_id: int) -> None:
    if not 0 <= layer_id < len(layers):
        raise ValueError(f"init_context_from_target: layer {layer_id} is outside the target's {len(layers)} layers")
    taps = drafter.config.target_layer_ids
    if layer_id == 0:
        raise ValueError("init_context_from_target: target layer 0 reads the embeddings, which are never tapped")
    if layer_id - 1 not in taps:
        raise ValueError(f"init_context_from_target: target layer {layer_id} reads tap {layer_id - 1}, which is not "
                         f"among the head's taps {taps}")


@torch.no_grad()
def copy_target_context(drafter: DFlash2DraftModel, target, layer_id: int) -> int:
    """Start the head's context projection as what target layer ``layer_id`` reads: ``fc`` passes the tap of
    that layer's input (tap ``layer_id - 1``, the output of the layer below) through unchanged and zeroes the
    others, and ``hidden_norm`` applies that layer's ``input_layernorm`` scale. A head layer copied from
    ``layer_id`` then projects the context's keys and values as the target layer does (exactly for a target
    with q/k norms; for one without, the head's key norm leaves the direction and ``calibrate_query_key_norms``
    the typical scale), so its attention over the context starts as the target's own. -> the tap's index among
    the head's taps.

    Refused by name, before anything is written: ``layer_id`` outside the target, or its input not among the
    head's taps (``dflash_config.target_layer_ids``)."""
    layers = target_decoder_layers(target)
    check_context_layer(drafter, layers, layer_id)
    taps = drafter.config.target_layer_ids
    slot, hidden = taps.index(layer_id - 1), drafter.config.hidden_size
    weight = drafter.fc.weight
    weight.zero_()
    weight[:, slot * hidden:(slot + 1) * hidden] = torch.eye(hidden, dtype=weight.dtype, device=weight.device)
    norm = layers[layer_id].input_layernorm
    drafter.hidden_norm.weight.copy_(_norm_scale(norm, norm.weight).to(drafter.hidden_norm.weight.dtype))
    return slot


@torch.no_grad()
def calibrate_query_key_norms(drafter: DFlash2DraftModel, target, layer_ids: list[int], input_ids: torch.Tensor
                              ) -> dict[int, tuple[float, float]]:
    """For copied layers whose target layer has no q/k norms (Llama, Mistral): the head's q/k norms (Qwen3-style,
    one RMS norm per head) set every query and key to unit RMS, which changes the copied attention's temperature.
    Their weights become the mean per-head RMS of that target layer's queries and keys on ``input_ids`` [1, T]
    (training text), so the normed ones keep the target's typical scale. -> {target layer: (query, key) scale}."""
    layers = target_decoder_layers(target)
    wanted = [(head_layer, index) for head_layer, index in zip(drafter.layers, layer_ids)
              if not hasattr(layers[index].self_attn, "q_norm")]
    if not wanted:
        return {}
    seen, hooks = {}, []
    for _, index in wanted:
        attention = layers[index].self_attn
        for name in ("q_proj", "k_proj"):
            hooks.append(getattr(attention, name).register_forward_hook(
                lambda module, args, out, key=(index, name): seen.__setitem__(key, out.float())))
    try:
        target(input_ids.to(target.device), logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    scales = {}
    for head_layer, index in wanted:
        attention = head_layer.self_attn

        def rms(out):
            return out.unflatten(-1, (-1, attention.head_dim)).pow(2).mean(-1).sqrt().mean().item()

        scales[index] = (rms(seen[(index, "q_proj")]), rms(seen[(index, "k_proj")]))
        attention.q_norm.weight.fill_(scales[index][0])
        attention.k_norm.weight.fill_(scales[index][1])
    return scales


@torch.no_grad()
def calibrated_output_factor(drafter: DFlash2DraftModel, target) -> float:
    """A factor <= 1 for a fresh head's logits (see ``calibrated_output_scale``): the trainer ramps the head's
    logit scale from it to 1 over its first steps."""
    scale = drafter.norm.weight.detach().float().cpu()
    return float((calibrated_output_scale(drafter, target, scale) / scale.clamp_min(1e-6)).median())


@torch.no_grad()
def calibrated_output_scale(drafter: DFlash2DraftModel, target, scale: torch.Tensor) -> torch.Tensor:
    """An output-norm scale ``scale`` [H] (the head's own), times a factor <= 1.

    Every drafted position of a fresh head reads the mask token's embedding and its layers barely change
    the residual, so its output points along that embedding; with a tied LM head the mask token then gets
    a logit far above every other token (a first training loss many times the uniform one, worst on
    Gemma's sqrt(H)-scaled embeddings). The factor keeps that output's logits within 1 nat of their mean,
    which puts the first loss at about the uniform guess; training grows the scale back.
    """
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    mask_row = embed[drafter.config.mask_token_id].float().cpu() * drafter.config.input_embedding_scale
    direction = mask_row * torch.rsqrt(mask_row.pow(2).mean() + drafter.config.rms_norm_eps)
    logits = F.linear((direction * scale).to(device=head.device, dtype=head.dtype), head)
    spread = float((logits.float() - logits.float().mean()).abs().max())
    return scale * min(1.0, 1.0 / spread) if spread > 0 else scale
