"""The budget: ``--budget`` split into phases from measured rates (``make_plan``), the plan as printed, and the
one progress display (phase, ETA, held-out τ)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace

from tqdm.auto import tqdm

from .. import regenerate as regenerate_module
from .. import store as store_module
from .. import trainer as trainer_module
from .recipe import DistillRecipe, RunState


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


def evaluation_seconds(prompts: int, tokens: int, rates: dict) -> float:
    """Five decodes per prompt (greedy as loaded and on oneDNN, head alone, default loop, prompt lookup) and a
    warm-up."""
    return (prompts + 1) * tokens * rates["greedy_seconds_per_token"] * 5 * 1.2


def make_plan(budget: float, spent: float, rates: dict, recipe: DistillRecipe, stored_tokens: int = 0,
              store_done: bool = False, store_tokens: int | None = None, trunk_done: int = 0,
              warmup: int | None = None) -> dict:
    """Split what is left of ``budget`` (seconds; ``spent`` already used) into phases, from measured ``rates``.

    The evaluation takes what its prompts cost (at most ``eval_share`` of the budget, fewer prompts when
    needed), the store ``store_share`` of the rest (unless it is built already), training the remainder:
    ``cool_share`` of all the training steps (a continued run's done trunk steps included) cool down, the
    others extend the trunk. The recipe's explicit
    ``store_tokens`` / ``trunk_steps`` / ``cool_steps`` win over the rates."""
    left = max(0.0, budget - spent)
    prompts = recipe.eval_prompts
    while prompts > 2 and evaluation_seconds(prompts, recipe.eval_max_new_tokens, rates) > recipe.eval_share * budget:
        prompts //= 2
    eval_seconds = evaluation_seconds(prompts, recipe.eval_max_new_tokens, rates)
    checks = recipe.checks * (recipe.check_prompts * recipe.check_max_new_tokens * rates["greedy_seconds_per_token"])
    work = max(0.0, left - eval_seconds - checks - rates.get("export_seconds", 5.0))
    per_token = recipe.regen_share / rates["regen_tokens_per_s"] + 1 / rates["prefill_tokens_per_s"]
    if store_done:
        quota, store_seconds = store_tokens, 0.0
    else:
        quota = recipe.store_tokens or max(recipe.min_store_tokens, stored_tokens + int(recipe.store_share * work
                                                                                         / per_token))
        store_seconds = max(0, quota - stored_tokens) * per_token
    train_seconds = max(0.0, work - store_seconds)
    steps = train_seconds / rates["seconds_per_step"]
    # The cool-down decays the whole trunk, a continued run's earlier steps included: its share is of all the
    # training, taken from this call's steps.
    cool = recipe.cool_steps or max(recipe.min_cool_steps,
                                    min(int(steps), int(round((trunk_done + steps) * recipe.cool_share))))
    trunk = recipe.trunk_steps or max(recipe.min_trunk_steps, trunk_done + int(steps - cool))
    trunk = max(trunk, trunk_done)
    if warmup is None:
        warmup = max(1, min(recipe.warmup_steps, trunk // 10))
    trunk = max(trunk, warmup)
    regen = int(round(quota * recipe.regen_share))
    return {
        "budget_seconds": budget,
        "spent_seconds_at_plan": round(spent, 1),
        "store_tokens": int(quota),
        "regen_tokens": regen,
        "sharegpt_tokens": int(quota) - regen,
        "store_seconds": round(store_seconds, 1),
        "warmup_steps": int(warmup),
        "trunk_steps": int(trunk),
        "trunk_seconds": round((trunk - trunk_done) * rates["seconds_per_step"], 1),
        "cool_steps": int(cool),
        "cool_seconds": round(cool * rates["seconds_per_step"], 1),
        "eval_prompts": prompts,
        "eval_max_new_tokens": recipe.eval_max_new_tokens,
        "eval_seconds": round(eval_seconds + checks, 1),
        "planned_seconds": round(spent + store_seconds + (trunk - trunk_done + cool) * rates["seconds_per_step"]
                                 + eval_seconds + checks, 1),
    }


# A larger budget grows a finished store only by at least this share: each growth costs a regeneration batch, a
# new plan and a new cool-down, which a few percent more data does not repay.
STORE_GROWTH_MIN = 0.05


def plan_for_budget(state: RunState, budget: float, spent: float, rates: dict, recipe: DistillRecipe, store,
                    sources: dict | None = None) -> dict:
    """The plan for ``budget`` from where the run stands (``spent`` seconds used, ``store`` as built so far).

    An unfinished store is planned its ``store_share`` of the time left. A finished store is kept, unless the
    budget is larger than the one it was built for: then it grows to the store a first call with this budget
    would plan (when that adds at least ``STORE_GROWTH_MIN``, and the data did not run out last time), since
    more steps over the same sequences memorise them; the rest of the new time trains on. A store that grows
    is marked unbuilt (``state.undo("store")``). It grows only on the text it was built from (``sources``,
    ``recipe.text_sources``, against those its entry records): other text would add other sequences, in
    another order."""
    old = state.data.get("plan") or {}
    common = dict(stored_tokens=store.num_tokens, trunk_done=state.data.get("trunk_step", 0),
                  warmup=old.get("warmup_steps"))
    if not state.done("store"):
        return make_plan(budget, spent, rates, recipe, store_done=False, **common)
    built = state.data["done"]["store"]
    larger = budget > old.get("budget_seconds", budget)
    data_left = (not (isinstance(built, dict) and built.get("data_ran_out"))
                 and other_store_sources(state, sources) is None)
    if recipe.store_tokens is None and larger and data_left:
        wanted = make_plan(budget, 0.0, rates, recipe)["store_tokens"]  # what a first call with this budget builds
        if wanted >= (1 + STORE_GROWTH_MIN) * store.num_tokens:
            state.undo("store")
            return make_plan(budget, spent, rates, replace(recipe, store_tokens=wanted), store_done=False, **common)
    if recipe.store_tokens is not None and recipe.store_tokens > store.num_tokens and data_left:
        state.undo("store")  # a recipe's explicit store size, raised
        return make_plan(budget, spent, rates, recipe, store_done=False, **common)
    return plan_on_built_store(state, budget, spent, rates, recipe, store)


def other_store_sources(state: RunState, sources: dict | None) -> dict | None:
    """The text sources the finished store records when they are not ``sources``, else None (also for a store
    built before sources were recorded, or not finished)."""
    built = state.data.get("done", {}).get("store")
    recorded = built.get("sources") if isinstance(built, dict) else None
    return recorded if recorded not in (None, sources) else None


def plan_on_built_store(state: RunState, budget: float, spent: float, rates: dict, recipe: DistillRecipe,
                        store) -> dict:
    """The plan that keeps ``store`` as it is: what is left of ``budget`` goes to the training phases, from the
    trunk's done steps on."""
    warmup = (state.data.get("plan") or {}).get("warmup_steps")
    return make_plan(budget, spent, rates, recipe, stored_tokens=store.num_tokens, store_done=True,
                     store_tokens=store.num_tokens, trunk_done=state.data.get("trunk_step", 0), warmup=warmup)


def adopt_plan(state: RunState, plan: dict, old: dict) -> None:
    """Make ``plan`` the run's, undoing the finished phases it changes: a trunk planned past its end goes on,
    and the cool-down, export, evaluation and push after a changed trunk or cool-down are redone."""
    state.data.pop("trunk_step_end", None)  # an end fitted to the old plan
    if state.done("trunk") and plan["trunk_steps"] > state.data["done"]["trunk"]["step"]:
        state.undo("trunk")
    if not state.done("trunk") or plan["cool_steps"] != old.get("cool_steps"):
        state.undo("cool", "export", "evaluate", "push")
    if any(plan[k] != old.get(k) for k in ("eval_prompts", "eval_max_new_tokens")):
        state.undo("evaluate", "push")
    state.data["plan"] = plan


def format_plan(plan: dict, rates: dict, name: str) -> str:
    over = plan["planned_seconds"] - plan["budget_seconds"]
    lines = [
        f"distill plan for {name}: budget {format_seconds(plan['budget_seconds'])}, "
        f"{format_seconds(plan['spent_seconds_at_plan'])} spent",
        f"  measured    regeneration {rates['regen_tokens_per_s']:,.0f} tok/s, prefill "
        f"{rates['prefill_tokens_per_s']:,.0f} tok/s, training {rates['seconds_per_step']:.3g} s/step, greedy "
        f"decoding {1000 * rates['greedy_seconds_per_token']:.3g} ms/token ({rates.get('device', '?')}, "
        f"{rates.get('precision', '?')})",
        f"  store       {format_seconds(plan['store_seconds']):>7}  {plan['store_tokens']:,} tokens: "
        f"{plan['regen_tokens']:,} of the target's own responses + {plan['sharegpt_tokens']:,} of ShareGPT text",
        f"  trunk       {format_seconds(plan['trunk_seconds']):>7}  to step {plan['trunk_steps']:,} at a constant "
        f"rate (warmup {plan['warmup_steps']})",
        f"  cool-down   {format_seconds(plan['cool_seconds']):>7}  {plan['cool_steps']:,} steps of a copy, the rate "
        "1 - sqrt down to 0",
        f"  evaluation  {format_seconds(plan['eval_seconds']):>7}  {plan['eval_prompts']} held-out prompts x "
        f"{plan['eval_max_new_tokens']} tokens: head alone, default loop, plain greedy, prompt lookup",
    ]
    if over > 0.05 * plan["budget_seconds"]:
        lines.append(f"  note: the minimum plan runs {format_seconds(over)} over the budget")
    return "\n".join(lines)


class Display:
    """The one progress display: a bar over the budget's seconds, the phase, its ETA and the held-out τ."""

    def __init__(self, budget: float, spent: float, enabled: bool = True, started: float | None = None):
        self.budget, self.base, self.started = budget, spent, started or time.perf_counter()
        self.phase, self.phase_started, self.phase_seconds = "start", self.started, 0.0
        self.fraction, self.tau = 0.0, None
        self.bar = tqdm(total=max(1, round(budget)), initial=min(round(spent), round(budget)), desc="distill",
                        bar_format="{desc}  {percentage:3.0f}%|{bar}|", disable=not enabled, leave=True)
        self.refresh()

    def spent(self) -> float:
        return self.base + time.perf_counter() - self.started

    def start(self, phase: str, planned_seconds: float = 0.0) -> None:
        self.phase, self.phase_started, self.phase_seconds = phase, time.perf_counter(), planned_seconds
        self.fraction = 0.0
        self.refresh()

    def update(self, fraction: float | None = None, tau: float | None = None) -> None:
        if fraction is not None:
            self.fraction = min(1.0, max(0.0, fraction))
        if tau is not None:
            self.tau = tau
        self.refresh()

    def phase_eta(self) -> float:
        elapsed = time.perf_counter() - self.phase_started
        if self.fraction > 0.02:
            return elapsed * (1 - self.fraction) / self.fraction
        return max(0.0, self.phase_seconds - elapsed)

    def refresh(self) -> None:
        spent = self.spent()
        self.bar.n = min(round(spent), self.bar.total)
        tau = "–" if self.tau is None else f"{self.tau:.2f}"
        self.bar.set_description_str(f"distill [{self.phase}] {format_seconds(spent)}/{format_seconds(self.budget)}"
                                     f" · {self.phase} ETA {format_seconds(self.phase_eta())} · held-out τ {tau}",
                                     refresh=True)

    def write(self, text: str) -> None:
        if self.bar.disable:
            print(text, flush=True)
        else:
            self.bar.write(text)

    def close(self) -> None:
        self.refresh()
        self.bar.close()


@contextmanager
def inner_bars_off():
    """The store, regeneration and trainer each draw a bar of their own: off while the one display runs."""
    def quiet(*args, **kwargs):
        kwargs["disable"] = True
        return tqdm(*args, **kwargs)

    modules = (regenerate_module, store_module, trainer_module)
    saved = [module.tqdm for module in modules]
    for module in modules:
        module.tqdm = quiet
    try:
        yield
    finally:
        for module, original in zip(modules, saved):
            module.tqdm = original
