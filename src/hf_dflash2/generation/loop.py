"""The fast speculative loop: one file where a round happens, read top to bottom.

``speculative_generate`` (the public entry point) resolves the call's settings (``config.py``), builds the
round's helpers (the verify policy, the target's logits processors, the sampler, the output buffers), runs
``prefill`` and hands over to ``speculative_decode``, the round loop. Every round has five steps:

1. **propose**: the drafter proposes a block of tokens per row in one pass (skipped on rounds the verify
   policy turns into plain AR steps), and rows whose text repeats may take an n-gram draft instead
   (``speculative_dflash2.propose``);
2. **plan**: the policy picks how many drafts to verify (``cost_model_dflash2``), on greedy rounds where
   the head drafted possibly a tree of its likeliest continuations and the n-gram's chain (``trees.py``);
   the host reads one small tensor (any row still running, all rows running, how many trailing cache slots
   no running row needs, the plan), and finished rows leave the batch;
3. **verify**: one target forward over ``[anchor, drafts[:k]]`` (``verify``);
4. **accept**: the target's logits processors (``processors.py``), then greedy match or lossless rejection
   sampling (``sampling.py``), or the path of a tree the target's picks follow;
5. **commit**: the accepted tokens are written up to EOS, the budget or a stop (``outputs.py``), and the
   anchor and accepted drafts become the drafter's context (``DraftContext``, shared with the Transformers
   path); the target's bonus token is the next anchor.

Everything but that host read (and, only when rows finish, which rows to drop) stays on the device.
Rows accept different numbers of tokens, so slots rejected by one row but kept by another stay in the
caches as masked holes; the trailing slots that no row needs are cropped every round (at batch 1 there
are never holes). Finished rows are removed from the batch so they stop costing compute.

Shapes: N rows of the call, n rows still running, P the prompt length, V the target's vocabulary, k a
round's verified drafts, w = k + 1 its verified slots, H the target's hidden size.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator

import torch
from torch.profiler import record_function
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..cost_model_dflash2 import (
    CostModel,
    VerifyPolicy,
    check_verify_policy,
    starting_cost_model,
    verify_policy_for,
)
from ..cpu.attention import packed_gqa_attention
from ..kernels_dflash2 import ForwardKernels
from ..speculative_dflash2 import (
    DEFAULT_NGRAM_SIZE,
    DraftContext,
    Proposal,
    SpeculativeStats,
    check_ngram_size,
    last_position,
    make_proposal,
    propose,
    round_block_size,
    takes_logits_processor,
    tapped_features,
)
from .config import (
    PROCESSED_SETTINGS,
    UNSET,
    check_input_ids,
    check_max_new_tokens,
    check_sampling,
    eos_tensor,
    mask_from_padding,
    new_token_budget,
    pad_id,
    resolve_generation_config,
    validate_generation_inputs,
)
from .outputs import OutputBuffer, Rows, SpeculativeOutput, TokenScores
from .processors import TargetLogitsProcessors
from .sampling import Sampler
from .trees import (
    DraftTree,
    HeadNodes,
    accept_tree,
    build_tree,
    gather_path,
    move_path_to_front,
    path_out_of_place,
    rank_continuations,
    spelling,
    supports_trees,
    tree_attention_mask,
)


def prefill(target, drafter, input_ids, attention_mask, capacity: int):
    """One target forward over the prompts: fills its KV cache and the drafter's context.

    Args:
        target (`PreTrainedModel`): the causal LM.
        drafter (`DFlash2DraftModel`): the head, whose ``target_layer_ids`` name the hidden states it reads.
        input_ids (`torch.LongTensor` of shape `(N, P)`): the prompts, left-padded.
        attention_mask (`torch.LongTensor` of shape `(N, P)`): 1 on text, 0 on padding.
        capacity (`int`): the context's slots, room for the prompt and every round after it.

    Returns:
        `tuple`: the target's ``DynamicCache``, a ``DraftContext`` holding P slots, and the float logits after
        the prompts, of shape `(N, V)`.
    """
    layer_ids = drafter.config.target_layer_ids
    positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=target.config)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()  # lets sliding-window layers be cropped
    out = target(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache,
                 use_cache=True, output_hidden_states=[i + 1 for i in layer_ids],
                 logits_to_keep=last_position(input_ids.shape[1], input_ids.device))
    context = DraftContext(drafter, input_ids.shape[0], capacity, input_ids.device)
    context.append(tapped_features(out.hidden_states, layer_ids), positions, attention_mask.bool())
    return cache, context, out.logits[:, -1].float()


def verify(target, layer_ids, cache, context: DraftContext, ids: torch.Tensor, positions: torch.Tensor,
           tree: DraftTree | None = None):
    """Step 3 of a round: one target forward over the anchor and the drafts, seeing the context's valid slots
    (and, for a ``tree``, each slot its own branch only).

    Args:
        target (`PreTrainedModel`): the causal LM.
        layer_ids (`list[int]`): the target layers the drafter reads (``drafter.config.target_layer_ids``).
        cache (`DynamicCache`): the target's cache, extended by the forward.
        context (`DraftContext`): the drafter's context, whose valid slots give the attention mask.
        ids (`torch.LongTensor` of shape `(n, w)`): the anchor, then the drafts (a chain, or a tree's slots).
        positions (`torch.LongTensor` of shape `(n, w)`): their positions (a tree slot's: the anchor's plus
            its depth).
        tree (`DraftTree`, *optional*): the tree ``ids`` spell, whose ancestry masks the slots' attention.

    Returns:
        `tuple`: float logits of shape `(n, w, V)` (slot j's: the target's after ``ids[:, j]``) and the tapped
        features of shape `(n, w, taps * H)`.
    """
    mask = context.verify_mask(ids.shape[1])
    if tree is not None:
        mask = tree_attention_mask(mask, tree, target.config._attn_implementation, target.dtype)
    out = target(input_ids=ids, attention_mask=mask, position_ids=positions,
                 cache=cache, use_cache=True, output_hidden_states=[i + 1 for i in layer_ids])
    return out.logits.float(), tapped_features(out.hidden_states, layer_ids)


def observe_tree_round(policy: VerifyPolicy, draft: Proposal, tree: DraftTree, result) -> None:
    """A tree round calibrates the tree's head nodes by depth, and the head's chain and the n-gram's as
    far as each was in the tree."""
    m = tree.head_nodes
    policy.observe_tree(draft.node_logp[:, :m], draft.node_depth[:, :m], result.node_accepted)
    policy.observe(draft.head_confidence, result.greedy_verified, result.greedy_accepted,
                   torch.zeros_like(result.accepted))
    if tree.ngram_slots:
        ngram_source = torch.where(draft.ngram_size > 0, draft.ngram_size, -1)
        policy.observe(torch.ones_like(draft.head_confidence), result.ngram_verified, result.ngram_accepted,
                       ngram_source)


def speculative_decode(target, drafter, cache, context: DraftContext, rows: Rows, output: OutputBuffer,
                       policy: VerifyPolicy, sampler: Sampler, stats: SpeculativeStats, block_size: int,
                       streamer=None, ngram_size: int = 0, trees: bool = False,
                       processors: TargetLogitsProcessors | None = None, deadline: float | None = None,
                       token_scores: TokenScores | None = None) -> None:
    """The round loop: propose -> plan -> verify -> accept -> commit, until every row has finished.

    With ``trees``, a round where the head drafted may verify a tree: its likeliest continuations and the
    n-gram's chain (``trees.py``), as the policy plans. Tree nodes are fixed drafts (the head drafts greedily),
    so the target's token after a slot is its argmax or, when sampling, a draw (``Sampler.pick_along_tree``).

    Args:
        target (`PreTrainedModel`): the causal LM, prefilled.
        drafter (`DFlash2DraftModel`): the head, bound to ``target``.
        cache (`DynamicCache`): the target's cache after the prefill.
        context (`DraftContext`): the drafter's context after the prefill.
        rows (`Rows`): the N running rows: their first token (the anchor) and its position.
        output (`OutputBuffer`): the generated text, holding each row's first token.
        policy (`VerifyPolicy`): picks how many drafts (or which tree) each round verifies.
        sampler (`Sampler`): the target's token choice and the acceptance rule.
        stats (`SpeculativeStats`): filled with each round's counts.
        block_size (`int`): the anchor plus the most drafts a round verifies.
        streamer (*optional*): receives each round's committed tokens (batch 1).
        ngram_size (`int`, defaults to 0): the longest suffix an n-gram draft matches; 0: no n-gram drafts.
        trees (`bool`, defaults to `False`): whether rounds where the head drafted may verify a tree.
        processors (`TargetLogitsProcessors`, *optional*): process the verified logits slot by slot first.
        deadline (`float`, *optional*): a ``time.monotonic()`` after which every row stops after its round,
            as ``max_time`` stops ``generate``.
        token_scores (`TokenScores`, *optional*): records the logits that chose each committed token.
    """
    layer_ids, offsets = drafter.config.target_layer_ids, output.offsets
    unused_tail = torch.zeros((), dtype=torch.long, device=rows.anchor.device)
    no = torch.zeros((), dtype=torch.bool, device=rows.anchor.device)
    path_order, path_moves = None, no  # last round's tree path, moved to the cache's front after the host read
    rank_nodes = (lambda out: rank_continuations(drafter, out, block_size - 1)) if trees else None
    # with trees the head's q never meets the target (tree nodes and n-gram chains are fixed drafts)
    draft_temperature = 0.0 if trees else sampler.draft_temperature
    vocab = drafter.bound_target.lm_head_weight.shape[0]
    draft_hook = processors is not None and takes_logits_processor(drafter)
    longest = int(output.count.max())  # tokens generated by any row, at most (a bound kept on the host)
    policy.room = output.max_new_tokens - 2  # every row has written its first token
    while True:
        # 1. propose: the head's block (or a plain step's none), and n-gram drafts where the text repeats
        history = length = None
        if ngram_size:  # no row's text is longer than ``longest``: the lookup reads no further
            history = output.history[rows.index, : output.prompt_length + longest]
            length = output.prompt_length + output.count[rows.index]
        draft, head_drafted = propose(drafter, policy, context, rows.anchor, rows.anchor_pos, block_size,
                                      draft_temperature, sampler.generator, ngram_size, history, length,
                                      rank_nodes, processors.for_drafts(output, rows) if draft_hook else None)
        stats.draft_passes += head_drafted
        tree_round = trees and head_drafted

        # 2. plan: how many drafts to verify, or which tree; the host read; finished rows leave the batch
        with record_function("dflash2::plan"):
            if tree_round:  # (m, kg): the head's m likeliest continuations and the n-gram's first kg drafts
                nodes = HeadNodes(draft.node_tokens, draft.node_depth, draft.node_logp, draft.node_parent)
                if draft.ngram_tokens is None:
                    draft.ngram_size = torch.zeros_like(rows.anchor)
                    spells = torch.zeros_like(draft.node_tokens, dtype=torch.bool)
                else:
                    spells = spelling(nodes, draft.ngram_tokens)
                plan = [*policy.choose_tree(draft.node_logp, draft.node_depth, draft.ngram_size, spells)]
            else:  # (k, -)
                plan = [0 if draft is None else policy.choose(draft.confidence, draft.source, head_drafted), 0]
        # The one host read per round: any row running, all rows running, trailing slots no row needs, the
        # plan, whether any row took the head's draft, whether last round's tree path must move, and the
        # most drafts a running row can still commit: a round writes a row's accepted drafts and one token
        # more, so with r tokens of its budget left a row can use r - 1 drafts.
        with record_function("dflash2::host_read"):
            room = output.max_new_tokens - 1 - output.count[rows.index]
            any_running, all_running, crop, k, k_ngram, head_used, move, most_room = torch.stack([
                (~rows.finished).any().long(), (~rows.finished).all().long(), unused_tail.long(),
                *(torch.as_tensor(x, device=no.device).long() for x in plan),
                (no if draft is None else draft.uses_head).long(), path_moves.long(),
                torch.where(rows.finished, 0, room).max()]).tolist()
        if not any_running:
            return
        stats.verify_forwards += 1
        # a tree's m counts its nodes, not their depth: the tree is kept unless no row has room
        k, k_ngram = min(k, most_room) if not tree_round or most_room == 0 else k, min(k_ngram, most_room)
        policy.room = most_room
        with record_function("dflash2::cache"):
            if move:  # before the crop: the path's slots are among the cache's last W
                move_path_to_front(cache, path_order)
            path_order, path_moves = None, no
            if crop > 0:
                cache.crop(-crop)
                context.crop(crop)
            if not all_running:
                keep = (~rows.finished).nonzero().flatten()  # rows finished: drop them, they stop costing
                cache.batch_select_indices(keep)
                context.select(keep)
                rows = rows.select(keep)
                if draft is not None:
                    draft = draft.select(keep)

        tree = None
        with record_function("dflash2::tree"):
            if tree_round:
                k_ngram = k_ngram if draft.ngram_tokens is not None else 0
                head_used = k > 0
                if k == 0:  # the n-gram's chain alone (a linear round), or a plain step
                    if k_ngram:
                        draft = make_proposal(None, draft.ngram_tokens, draft.ngram_size, None, rows.anchor, vocab)
                    k = k_ngram
                else:
                    nodes = HeadNodes(draft.node_tokens, draft.node_depth, draft.node_logp, draft.node_parent)
                    tree = build_tree(nodes, k, draft.head_tokens, draft.ngram_tokens, k_ngram, block_size)
                    k = tree.width - 1
        if draft is not None:
            policy.chosen(k, bool(head_used))
        longest += k + 1

        # 3. verify: one target forward over the anchor and the k drafts (a chain, or the tree's slots)
        if tree is None:
            drafts = draft.tokens[:, :k] if k else rows.anchor[:, None][:, :0]
            ids = torch.cat([rows.anchor[:, None], drafts], dim=1)
        else:
            ids = torch.cat([rows.anchor[:, None], tree.tokens], dim=1)
        positions = rows.anchor_pos[:, None] + offsets[: k + 1]  # a chain's slots; a tree's path once accepted
        with record_function("dflash2::verify"):
            logits, features = verify(target, layer_ids, cache, context, ids,
                                      positions if tree is None else rows.anchor_pos[:, None] + tree.depth, tree)

        # 4. accept: the processors on every slot's own text, then the target's choice against the drafts
        with record_function("dflash2::accept"):
            raw_path = logits
            if processors is not None:
                logits = processors.round(output, rows, ids, logits, tree)
            processed_path = logits
            if tree is None:
                accepted, tokens = sampler.accept(drafts, draft, logits)
                source = None if draft is None else draft.source
                policy.observe(None if draft is None else draft.confidence, k, accepted, source)
            else:
                result = accept_tree(tree, sampler.pick_along_tree(logits, tree))
                # as if the path was verified alone: the features now, the cache after the next host read
                features = gather_path(features, result.order)
                if token_scores is not None:
                    raw_path, processed_path = gather_path(raw_path, result.order), gather_path(logits, result.order)
                path_order, path_moves = result.order, path_out_of_place(result.order, result.accepted)
                accepted, tokens = result.accepted, result.tokens
                observe_tree_round(policy, draft, tree, result)
                source = torch.where(result.winner == 1, draft.ngram_size, 0)

        # 5. commit: write the accepted tokens and the bonus (up to EOS, the budget, a stop); the anchor and the
        # accepted drafts become the drafter's context, and the bonus is the next anchor
        with record_function("dflash2::commit"):
            spans = None
            if token_scores is not None:  # before the commit: stopping criteria read this round's scores
                spans = token_scores.record(rows, output.count[rows.index], accepted + 1, raw_path,
                                            sampler.warp(processed_path) if token_scores.scores is not None else None)
            written, within, rows.finished = output.commit(rows, tokens, accepted + 1)
            if spans is not None:
                token_scores.trim(spans, written)
            stats.record(accepted, written, verified=k, source=source, tree=tree is not None)
            if deadline is not None and time.monotonic() > deadline:
                rows.finished = torch.ones_like(rows.finished)
        if streamer is not None:
            streamer.put(tokens[0, : int(written[0])].cpu())
        with record_function("dflash2::context"):
            context.append(features, positions, within)
        rows.anchor = tokens.gather(1, accepted[:, None]).squeeze(1)
        rows.anchor_pos = rows.anchor_pos + accepted + 1
        unused_tail = torch.where(rows.finished, k + 1, k - accepted).min()
        policy.room = most_room - 1  # every running row commits at least one token a round


@contextlib.contextmanager
def loop_forwards(target, drafter, n_rows: int, block_size: int, packed_attention: bool = True,
                  linear_kernel: str | None = "auto") -> Iterator[None]:
    """What the loop's forwards run on for the length of one call, put back as it was on exit: the packed
    grouped-query attention (``packed_attention``) and, on CPU, each forward's linear layers on the kernel
    ``ForwardKernels`` picks for its width (``linear_kernel``)."""
    with packed_gqa_attention(target, packed_attention), ForwardKernels(target, drafter, n_rows, block_size,
                                                                        linear_kernel):
        yield


def loop_cost_model(target, drafter, batch_size: int, linear_kernel: str | None = "auto",
                    expected_context: int = 256) -> CostModel:
    """The cost model ``speculative_generate`` starts from when called with its defaults on ``batch_size`` rows
    of about ``expected_context`` tokens (the prompt plus half the new ones): the block it widens for n-gram
    drafts (as far from the context limit as short prompts are), under ``loop_forwards``. Measured and cached
    when missing, as the loop would; the adaptive policy then scales it by the call's own timed rounds.
    ``hf-dflash2 bench --profile`` prints it."""
    block_size = round_block_size(drafter, DEFAULT_NGRAM_SIZE)
    drafter.bind_target(target)
    with loop_forwards(target, drafter, batch_size, block_size, linear_kernel=linear_kernel):
        return starting_cost_model(target, drafter, batch_size, block_size, expected_context)


@torch.no_grad()
def speculative_generate(
    target,
    drafter,
    input_ids: torch.LongTensor,
    attention_mask: torch.LongTensor | None = None,
    max_new_tokens: int | None = None,
    do_sample: bool | None = UNSET,
    temperature: float | None = UNSET,
    top_k: int | None = UNSET,
    top_p: float | None = UNSET,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    block_size: int | None = None,
    streamer=None,
    adaptive: bool = True,
    verify_policy: VerifyPolicy | None = None,
    cost_model: CostModel | None = None,
    ngram_size: int = DEFAULT_NGRAM_SIZE,
    draft_tree: bool = True,
    generation_config: GenerationConfig | None = None,
    tokenizer=None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
    packed_attention: bool = True,
    linear_kernel: str | None = "auto",
    **generation_kwargs,
) -> SpeculativeOutput:
    """Generate with the target, drafted by a dFlash 2 / DFlash 1 head. The output is the target's own: greedy
    text token for token, sampling by ``generate``'s law.

    The generation settings follow ``target.generate``'s precedence (``resolve_generation_config``): keyword
    arguments (an explicit ``None`` overrides, e.g. ``top_k=None`` is no top-k, as in ``generate``;
    ``max_new_tokens``, ``eos_token_id`` and ``pad_token_id`` at None are not given), then ``generation_config``,
    then ``target.generation_config``, then Transformers' defaults; so a call samples the law ``target.generate``
    would with the same arguments. Settings the loop does not apply (beams, guidance, top-h, ...) are refused
    by name where ``generate`` would apply them, before the prefill.

    Args:
        target (`PreTrainedModel`):
            The causal LM whose output this is.
        drafter (`DFlash2DraftModel` or `DFlashDraftModel`):
            The head; the call binds it to ``target``.
        input_ids (`torch.LongTensor` of shape `(batch_size, prompt_length)`):
            The prompts, left-padded when there are several.
        attention_mask (`torch.LongTensor` of shape `(batch_size, prompt_length)`, *optional*):
            1 on text, 0 on padding (on the left). When not given, leading pad tokens are padding, as
            ``generate`` infers them.
        max_new_tokens (`int`, *optional*):
            The length; else ``max_length`` minus the prompt (at most the context less a block), else 64 tokens.
        do_sample (`bool`, *optional*):
            Greedy unless set. Sampling is lossless: linear rounds by speculative sampling with the drafter's q,
            tree rounds by the target's own draws down the tree.
        temperature (`float`, *optional*), top_k (`int`, *optional*), top_p (`float`, *optional*):
            The sampling law, as ``generate`` applies them (then min-p / typical / epsilon / eta, when set).
        eos_token_id (`int` or `list[int]`, *optional*), pad_token_id (`int`, *optional*):
            Default: the configs' ids. With no pad token, finished rows are filled with the first EOS id.
        generator (`torch.Generator`, *optional*):
            The random source when sampling.
        block_size (`int`, *optional*):
            The anchor plus the most drafts a round verifies. Defaults to the head's, widened to 16 when n-gram
            drafts are on with the adaptive policy; the head always drafts within its own block.
        streamer (*optional*):
            Batch 1; a Transformers ``TextStreamer`` or anything with ``put``/``end``. Receives the prompt, then
            each round's committed tokens: one extra host read per round, only when streaming.
        adaptive (`bool`, defaults to `True`):
            Verify, each round, the number of drafts that maximises expected tokens per second under the
            measured ``cost_model``; ``False`` verifies the whole block. ``stats.verify_length_histogram``
            reports the choices.
        verify_policy (`VerifyPolicy`, *optional*):
            Overrides ``adaptive`` (e.g. ``ForcedVerifyLengths([0, 3, 1])``).
        cost_model (`CostModel`, *optional*):
            What a verify of each width costs; measured once per machine / dtype / shape and cached when not
            given.
        ngram_size (`int`, defaults to 3):
            At most 4; 0 turns it off. Rows may draft by prompt lookup instead, from the most recent earlier
            occurrence of their last ``n <= ngram_size`` tokens in the prompt or output, when the policy expects
            that to be accepted further than the head's draft (``stats.ngram_rounds``).
        draft_tree (`bool`, defaults to `True`):
            With the adaptive policy, not on sliding-window targets: a round may verify the head's likeliest
            continuations and the n-gram's chain as branches of one forward and keep the path accepted
            furthest (``stats.tree_rounds``); ``False``: one chain per row. When sampling, tree nodes are the
            head's greedy tokens, the target draws its tokens down the tree and the path follows the draws
            (still lossless); chains (``False``, and every round trees cannot take: ``adaptive=False``, a
            sliding-window target) draw their drafts from the head's q instead.
        generation_config (`GenerationConfig`, *optional*):
            Settings under the keyword arguments, over ``target.generation_config``.
        tokenizer (*optional*):
            Needed by ``stop_strings``, as with ``generate``.
        logits_processor (`LogitsProcessorList`, *optional*):
            Run, with the processors the settings ask for (repetition penalty, no-repeat n-grams, bad words,
            minimum lengths, ...), at every verified slot on that slot's own text (``TargetLogitsProcessors``:
            one small call per row and slot, only when one is on).
        stopping_criteria (`StoppingCriteriaList`, *optional*):
            Called after every committed token on the row's text up to it (one row at a time; the row's scores
            so far with ``output_scores``, else ``scores=None``, as ``generate``); a row ends where it fires.
        prefix_allowed_tokens_fn (`Callable[[int, torch.Tensor], list[int]]`, *optional*):
            Called with the prompt's index as ``generate`` calls it.
        packed_attention (`bool`, defaults to `True`):
            A target on ``sdpa`` with grouped-query attention runs ``cpu.attention.packed_gqa_sdpa`` during the
            call (the same attention without copying keys and values per query head; its cost model is
            measured and cached under it), and is put back on ``sdpa`` after.
        linear_kernel (`str`, *optional*, defaults to `"auto"`):
            On CPU, "auto" runs each forward's linear layers on the kernel measured fastest for its width
            (PyTorch's default or oneDNN with packed weights: the plain step, the verify and the draft pass
            each on their own; ``kernels_dflash2.ForwardKernels``), "default" / "onednn" one kernel for every
            forward, None the model as loaded. The layers are put back as they were when the call returns.
        generation_kwargs:
            Other ``GenerationConfig`` fields. ``stop_strings`` (with ``tokenizer``) end a row at the token that
            completes one, checked after every token; ``max_time`` stops every row after the round that passes
            it; ``num_return_sequences`` (sampling) repeats each prompt's row, as ``generate`` expands them;
            ``return_dict_in_generate`` with ``output_scores`` / ``output_logits`` fills the output's ``scores``
            / ``logits`` as ``generate``'s.

    Returns:
        `SpeculativeOutput`: ``sequences`` of shape `(batch_size * num_return_sequences, prompt_length + G)`
        (G the most tokens any row generated; rows right-padded with the pad id after their end),
        ``num_generated`` of shape `(batch_size * num_return_sequences,)`, ``stats``, and when asked
        ``scores`` / ``logits``.
    """
    check_ngram_size(ngram_size)
    check_input_ids(input_ids)
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2):
        raise ValueError(f"block_size must be an integer >= 2 (or None: the head's), got {block_size!r}")
    if verify_policy is not None:
        check_verify_policy(verify_policy)
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel (hf_dflash2.cost_model_dflash2; None: measured here), "
                        f"got {type(cost_model).__name__}")
    # eos / pad ids: None = not given (the configs' ids), as 0.1.0 read them
    config = resolve_generation_config(
        target, generation_config, do_sample=do_sample, temperature=temperature, top_k=top_k,
        top_p=top_p, eos_token_id=UNSET if eos_token_id is None else eos_token_id,
        pad_token_id=UNSET if pad_token_id is None else pad_token_id, **generation_kwargs,
    )
    # Given here, max_new_tokens bypasses GenerationConfig's check, which refuses 0 (a no-op call to us).
    if max_new_tokens is None:
        max_new_tokens = new_token_budget(config, input_ids.shape[1],
                                           target.config.get_text_config().max_position_embeddings,
                                           block_size or drafter.config.block_size)
    check_max_new_tokens(max_new_tokens)  # before any arithmetic on it
    stop_strings = None
    if config.stop_strings:
        if tokenizer is None:
            raise ValueError(f"stop_strings={config.stop_strings!r} needs the tokenizer: pass tokenizer=... "
                             "(as with target.generate)")
        from transformers.generation.stopping_criteria import StopStringCriteria

        stop_strings = StopStringCriteria(tokenizer, config.stop_strings)
    do_sample, top_k, top_p = bool(config.do_sample), config.top_k, config.top_p
    temperature = 1.0 if config.temperature is None else config.temperature
    room = (target.config.get_text_config().max_position_embeddings or 1 << 30) - input_ids.shape[1] - max_new_tokens
    # Only the adaptive policy chooses how far to verify, so only it gets the wider n-gram rounds.
    widen = adaptive and verify_policy is None
    block_size = round_block_size(drafter, ngram_size if widen else 0, block_size, room, cost_model)
    if attention_mask is None:  # as generate: leading pad tokens are padding (then checked as a given mask)
        attention_mask = mask_from_padding(input_ids, config)
    validate_generation_inputs(target, drafter, input_ids, attention_mask, max_new_tokens, block_size)
    if do_sample and not temperature > 0:
        raise ValueError(f"do_sample=True needs temperature > 0, got {temperature}")
    if do_sample:
        check_sampling(top_k, top_p)
    copies = config.num_return_sequences if config.num_return_sequences is not None else 1
    if not isinstance(copies, int) or copies < 1:
        raise ValueError(f"num_return_sequences must be a positive integer, got {copies!r}")
    if copies > 1:  # greedy is refused by GenerationConfig's validation, as in generate
        input_ids = input_ids.repeat_interleave(copies, dim=0)
        if attention_mask is not None:
            attention_mask = attention_mask.repeat_interleave(copies, dim=0)
    n_rows = input_ids.shape[0]
    if streamer is not None and n_rows != 1:
        copies_note = f" ({n_rows // copies} prompts x num_return_sequences={copies})" if copies > 1 else ""
        raise ValueError(f"streamer needs batch size 1, got {n_rows} rows{copies_note}")
    drafter.bind_target(target)
    device = input_ids.device
    # generate's fallback: with no pad token, finished rows are filled with the first EOS id (0 is a real token)
    pad_token_id, eos_ids = pad_id(config), eos_tensor(config.eos_token_id, "cpu")
    if pad_token_id is None:
        pad_token_id = int(eos_ids[0]) if len(eos_ids) else 0
    stats = SpeculativeStats(block_size)
    returned = bool(config.return_dict_in_generate)
    want_scores, want_logits = returned and bool(config.output_scores), returned and bool(config.output_logits)
    if max_new_tokens == 0:
        return SpeculativeOutput(input_ids.clone(), torch.zeros(n_rows, dtype=torch.long, device=device), stats,
                                 () if want_scores else None, () if want_logits else None)
    # the processors in force change which drafts pass: calls under other processors calibrate apart
    settings_key = (repr([getattr(config, name, None) for name in PROCESSED_SETTINGS]),
                    tuple(type(p).__qualname__ for p in logits_processor or ()), prefix_allowed_tokens_fn is not None)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    # built before the kernels are timed and the cost model measured: they check their settings
    processors = TargetLogitsProcessors(target, config, input_ids, attention_mask, max_new_tokens, logits_processor,
                                        prefix_allowed_tokens_fn)
    processors = processors if processors.active else None
    sampler = Sampler(do_sample, temperature, top_k, top_p, generator, config, device)
    with loop_forwards(target, drafter, n_rows, block_size, packed_attention, linear_kernel):
        running_attention = target.config._attn_implementation
        if cost_model is not None and cost_model.key.get("attention", running_attention) != running_attention:
            warnings.warn(f"cost_model was measured under {cost_model.key['attention']!r} attention, the call runs "
                          f"{running_attention!r} (packed_attention={packed_attention}): its verify costs may be off",
                          stacklevel=2)
        policy = verify_policy_for(target, drafter, n_rows, block_size, adaptive, verify_policy, cost_model,
                                   reproducible=do_sample, settings_key=settings_key,
                                   expected_context=input_ids.shape[1] + max_new_tokens // 2)
        stats.costs = policy.cost.as_dict() if isinstance(getattr(policy, "cost", None), CostModel) else None

        token_scores = None
        if want_scores or want_logits:
            token_scores = TokenScores(n_rows, max_new_tokens, target.get_output_embeddings().weight.shape[0], device,
                                        want_scores, want_logits)
        deadline = time.monotonic() + config.max_time if config.max_time is not None else None
        cache, context, last_logits = prefill(target, drafter, input_ids, attention_mask,
                                              input_ids.shape[1] + max_new_tokens + 2 * block_size)
        eos = eos_tensor(config.eos_token_id, device)
        criteria = StoppingCriteriaList(stopping_criteria) if stopping_criteria else None  # a plain list too
        output = OutputBuffer(input_ids, attention_mask, max_new_tokens, block_size, pad_token_id, eos, stop_strings,
                         criteria)
        output.token_scores = token_scores
        raw_logits = last_logits
        if processors is not None:
            last_logits = processors.first(output, last_logits)
        anchor = sampler.pick(last_logits)
        running = torch.zeros(n_rows, dtype=torch.bool, device=device)
        rows = Rows(torch.arange(n_rows, device=device), anchor, attention_mask.long().sum(-1), running)
        first = torch.ones_like(anchor)
        if token_scores is not None:  # before the commit, as in every round
            spans = token_scores.record(rows, torch.zeros_like(anchor), first, raw_logits[:, None],
                                        sampler.warp(last_logits)[:, None] if want_scores else None)
        written, _, rows.finished = output.commit(rows, anchor[:, None], first)
        if token_scores is not None:
            token_scores.trim(spans, written)
        if streamer is not None:
            streamer.put(input_ids[0].cpu())
            streamer.put(anchor.cpu())
        trees = draft_tree and policy.plans_trees and supports_trees(target, cache)
        speculative_decode(target, drafter, cache, context, rows, output, policy, sampler, stats, block_size, streamer,
                           ngram_size, trees, processors, deadline, token_scores)
        if streamer is not None:
            streamer.end()
    width = int(output.count.max())
    scores, logits = token_scores.columns(width) if token_scores is not None else (None, None)
    return SpeculativeOutput(torch.cat([input_ids, output.tokens[:, :width]], dim=1), output.count, stats,
                             scores, logits)
