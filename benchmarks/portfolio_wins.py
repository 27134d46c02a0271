"""Which portfolio members earn their place: the win table on the scheduler benchmark's batches.

For every batch of the benchmark grid (`scheduler_grid.sample_batches`: the same batches,
seeds and layouts as the recorded table) every member of `REGISTRY` that applies is built and
scored once (its simulated 1F1B step in its best order, deterministic), and `sim_search` is run
from whichever starts a member set would give it (cached per start). The portfolio's step for any
subset of members is then exact without re-running it: the fastest of the subset's candidates and
of the searches from the subset's fastest distinct starts, which is what `partition` with the
other members excluded returns (tested).

Per member, over the batches where it runs:
  - wins: batches where it is the fastest by more than `threshold` over the best other member
    (margin = the runner-up's step / the winner's); ties: within `threshold` of the fastest but
    not such a win (a tie earns nothing: the other member gives the same step);
  - loss when removed: the portfolio re-evaluated without it. `rows_hurt` counts grid rows (data
    set, n, m, dp) whose mean step / bound, the recorded table's number, rises by more than
    `threshold`; `row_loss_max` and `batch_loss_max` are the largest rises. The same for the
    greedy-path fallback (`greedy_partition`: no LP, no search), ``fb_*``, for members on it: the
    online service and the trainer's re-plans use it, and there a member can matter that the
    fluid-profile member overshadows in the full portfolio.
A member earns its place when it hurts a row of either when removed. `eliminate` removes, one at a
time, the member whose removal costs least while that is at most `threshold` (members that tie
each other each look free alone, so they are removed one by one and re-measured), until every
member earns.

The ILP is time-budgeted (its results depend on machine load), so it is not in the table; `ilp_rows`
measures it separately: warm-started from the portfolio's fastest candidate, scored by simulation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dflop.costmodel.types import BatchCosts
from dflop.scheduler import portfolio
from dflop.scheduler.evaluate import lower_bound
from dflop.scheduler.portfolio import (Candidate, Context, PortfolioSettings, build, context, fastest,
                                       ilp_applies, ilp_refine, run_sim_search, score, sim_applies, sim_refine)

SIM = "sim_search"
# Default materiality threshold: the recorded table prints step / bound to 3 decimals, so a
# change under 0.1 % of a row's mean does not show in it.
THRESHOLD = 1e-3


@dataclass
class Instance:
    """One benchmark batch: its scored member candidates (registry order) and cached searches."""

    dataset: str
    n: int
    m: int
    dp: int
    batch: int
    bound_s: float
    ctx: Context
    cands: list[Candidate]
    sim: bool
    greedy_path: frozenset[str] = frozenset()
    build_cpu_s: dict[str, float] = field(default_factory=dict)
    _searched: dict[str, Candidate] = field(default_factory=dict)

    def _search(self, ctx: Context, start: Candidate) -> Candidate:
        if start.member not in self._searched:
            self._searched[start.member] = run_sim_search(ctx, start)
        return self._searched[start.member]

    def run(self, members: frozenset[str]) -> list[Candidate]:
        """The candidates `partition` would score with only `members` (and `sim_search` if in it)."""
        scored = [c for c in self.cands if c.member in members]
        if not scored:
            return []
        if SIM in members and self.sim:
            scored = scored + sim_refine(self.ctx, scored, search=self._search)
        return scored

    def step(self, members: frozenset[str], fallback: bool = False) -> float:
        """The portfolio's step with only `members`; ``fallback``: only those of them on the greedy
        path (what `greedy_partition`, the online service's fallback, would return)."""
        cands = self.run(members & self.greedy_path if fallback else members)
        return fastest(cands).step_s if cands else float("inf")


def instances(batches, dataset: str, *, settings: PortfolioSettings = PortfolioSettings()) -> list[Instance]:
    """Instances of (n, m, dp, batch, costs, lengths) tuples (`sample_batches`), with dp_vision = dp
    and seed = batch as in the benchmark."""
    out = []
    for n, m, dp, b, costs, lengths in batches:
        out.append(make_instance(costs, m, dp, dataset=dataset, batch=b, lengths=lengths, settings=settings))
    return out


def make_instance(costs: BatchCosts, m: int, dp: int, *, dataset: str = "", batch: int = 0, lengths=None,
                  settings: PortfolioSettings = PortfolioSettings(), registry=None) -> Instance:
    ctx, members = context(costs, m, dp, dp, settings, seed=batch, lengths=lengths, registry=registry)
    # What several members share (the greedy pass, its search, a regrouping) is computed first, so
    # that each member's build time is its own.
    cpu = {}
    c0 = time.process_time()
    _ = ctx.greedy
    if dp > 1:
        _ = ctx.regrouped1
    cpu["(shared greedy)"] = time.process_time() - c0
    named = []
    for mem in members:
        c0 = time.process_time()
        named += build(ctx, [mem])
        cpu[mem.name] = time.process_time() - c0
    cands = score(ctx, named)
    bound = lower_bound(costs, m, dp, dp)
    return Instance(dataset, costs.n_samples, m, dp, batch, bound, ctx, cands, sim_applies(ctx.sit, settings),
                    frozenset(mem.name for mem in members if mem.greedy_path), cpu)


def member_names(insts: list[Instance]) -> list[str]:
    """Every member that offers a candidate somewhere, in registry order, then `sim_search`."""
    seen = {c.member for inst in insts for c in inst.cands}
    pos = {mem.name: i for i, mem in enumerate(portfolio.REGISTRY)}
    names = sorted(seen, key=lambda name: (pos.get(name, len(pos)), name))
    if any(inst.sim for inst in insts):
        names.append(SIM)
    return names


def _rows(insts: list[Instance]) -> dict[tuple, list[int]]:
    rows: dict[tuple, list[int]] = {}
    for k, inst in enumerate(insts):
        rows.setdefault((inst.dataset, inst.n, inst.m, inst.dp), []).append(k)
    return rows


def _row_ratio(insts: list[Instance], idx: list[int], steps: np.ndarray) -> float:
    return float(np.mean([steps[k] / insts[k].bound_s for k in idx]))


def _losses(insts: list[Instance], rows: dict, members: frozenset[str], name: str, fallback: bool):
    """(per-row rise of mean step / bound, per-batch rise of the step) when `name` is removed."""
    with_ = np.array([inst.step(members, fallback) for inst in insts])
    without = np.array([inst.step(members - {name}, fallback) for inst in insts])
    row_loss = {key: _row_ratio(insts, idx, without) / _row_ratio(insts, idx, with_) - 1 for key, idx in rows.items()}
    return row_loss, without / with_ - 1


def win_table(insts: list[Instance], members, *, threshold: float = THRESHOLD) -> pd.DataFrame:
    """One row per member of `members` (names; `sim_search` included if listed): where it runs,
    its wins and ties, its margins and what removing it costs (module docstring), in the portfolio
    and, for members on the greedy path, in the greedy-path fallback (``fb_*``; NaN otherwise)."""
    members = frozenset(members)
    rows = _rows(insts)
    full = [inst.run(members) for inst in insts]
    full_step = np.array([fastest(c).step_s for c in full])
    greedy_path = frozenset().union(*(inst.greedy_path for inst in insts))
    out = []
    for name in [n for n in member_names(insts) if n in members]:
        runs, wins, ties, margins, rows_run, rows_won = 0, 0, 0, [], set(), set()
        for k, (inst, cands) in enumerate(zip(insts, full)):
            mine = [c.step_s for c in cands if c.member == name]
            applies = inst.sim if name == SIM else any(c.member == name for c in inst.cands)
            if not applies:
                continue
            runs += 1
            key = (inst.dataset, inst.n, inst.m, inst.dp)
            rows_run.add(key)
            if not mine:        # sim_search found nothing faster than its starts
                continue
            others = [c.step_s for c in cands if c.member != name]
            best_other = min(others) if others else float("inf")
            margin = best_other / min(mine)
            if margin > 1 + threshold:
                wins += 1
                margins.append(margin)
                rows_won.add(key)
            elif min(mine) <= full_step[k] * (1 + threshold):
                ties += 1
        row_loss, batch_loss = _losses(insts, rows, members, name, fallback=False)
        hurt = sum(v > threshold for v in row_loss.values())
        fb_hurt, fb_row_max, fb_batch_max = 0, np.nan, np.nan
        if name in greedy_path:
            fb_row, fb_batch = _losses(insts, rows, members, name, fallback=True)
            fb_hurt, fb_row_max, fb_batch_max = (sum(v > threshold for v in fb_row.values()), max(fb_row.values()),
                                                 float(fb_batch.max()))
        out.append(dict(member=name, rows_run=len(rows_run), batches_run=runs, wins=wins, rows_won=len(rows_won),
                        ties=ties, margin_median=float(np.median(margins)) if margins else np.nan,
                        margin_max=max(margins) if margins else np.nan, rows_hurt=hurt,
                        row_loss_max=max(row_loss.values()), batch_loss_max=float(batch_loss.max()),
                        fb_rows_hurt=fb_hurt, fb_row_loss_max=fb_row_max, fb_batch_loss_max=fb_batch_max,
                        earns=hurt + fb_hurt > 0))
    return pd.DataFrame(out)


def eliminate(insts: list[Instance], members, *, threshold: float = THRESHOLD) -> tuple[list[str], pd.DataFrame]:
    """Backward elimination: while some member's removal raises no row's mean step / bound by more
    than `threshold`, in the portfolio nor in the greedy-path fallback, remove the one whose
    removal costs least (ties: the later in the registry) and re-measure. Returns (the members
    kept, one row per removal with what it cost at the time: row_loss_max, batch_loss_max and the
    fallback's fb_row_loss_max)."""
    kept = [n for n in member_names(insts) if n in set(members)]
    log = []
    while True:
        table = win_table(insts, kept, threshold=threshold)
        free = table[~table.earns]
        if free.empty:
            return kept, pd.DataFrame(log, columns=["member", "row_loss_max", "batch_loss_max", "fb_row_loss_max"])
        pos = {n: i for i, n in enumerate(kept)}
        cost = np.fmax(free.row_loss_max, free.fb_row_loss_max)
        worst = free.assign(cost=cost, pos=free.member.map(pos)).sort_values(["cost", "pos"],
                                                                             ascending=[True, False]).iloc[0]
        log.append(dict(member=worst.member, row_loss_max=worst.row_loss_max, batch_loss_max=worst.batch_loss_max,
                        fb_row_loss_max=worst.fb_row_loss_max))
        kept.remove(worst.member)


def row_table(insts: list[Instance], before, after, *, fallback: bool = False) -> pd.DataFrame:
    """Per grid row: mean step / bound (the recorded table's `dflop` column) with the members
    `before` and `after`, their ratio, and the worst batch's ratio (``fallback``: of the greedy
    path)."""
    before, after = frozenset(before), frozenset(after)
    out = []
    for (ds, n, m, dp), idx in _rows(insts).items():
        b = np.array([insts[k].step(before, fallback) for k in idx])
        a = np.array([insts[k].step(after, fallback) for k in idx])
        bound = np.array([insts[k].bound_s for k in idx])
        out.append(dict(dataset=ds, n=n, m=m, dp=dp, before=float(np.mean(b / bound)), after=float(np.mean(a / bound)),
                        ratio=float(np.mean(a / bound) / np.mean(b / bound)), worst_batch=float((a / b).max())))
    return pd.DataFrame(out)


def ilp_rows(insts: list[Instance], members, *, budget_s: float, everywhere: bool = False) -> pd.DataFrame:
    """The ILP on each batch where ``ilp="auto"`` runs it (every batch within `ilp_max_vars` with
    `everywhere`), warm-started from the fastest candidate of `members` and scored by simulation:
    one row per batch with the portfolio's step, the ILP's (NaN unless it returned a solution),
    its status and wall seconds. Depends on the machine's load (HiGHS stops at `budget_s`)."""
    members = frozenset(members)
    out = []
    for inst in insts:
        sit, s = inst.ctx.sit, inst.ctx.settings
        if not (ilp_applies(sit, s) or (everywhere and sit.n * sit.n_bins <= s.ilp_max_vars)):
            continue
        best = fastest(inst.run(members))
        t0 = time.perf_counter()
        found, status = ilp_refine(inst.ctx, best.bin_of, deadline=t0 + budget_s)
        wall = time.perf_counter() - t0
        out.append(dict(dataset=inst.dataset, n=inst.n, m=inst.m, dp=inst.dp, batch=inst.batch,
                        gated=ilp_applies(sit, s), step_s=best.step_s,
                        ilp_step_s=found[0].step_s if found else np.nan, status=status, wall_s=wall))
    return pd.DataFrame(out)


# Gates opened as far as they go, to measure what each gate costs (`gate_gains`).
OPEN_GATES = PortfolioSettings(lockstep_max_items_per_bin=float("inf"), profile_items_per_bin=(1.0, float("inf")),
                               ends_min_bubble=0.0)


def gate_gains(insts: list[Instance], settings: PortfolioSettings = PortfolioSettings(), *,
               threshold: float = THRESHOLD) -> pd.DataFrame:
    """What each member's gate costs. `insts` must be built with wider gates (`OPEN_GATES`); for
    each member and grid row where it ran outside its gate under `settings`, the row's mean step /
    bound with the members `settings` lets run, divided by the same with this one member also
    run everywhere (``gain``; ``fb_gain`` for the greedy-path fallback). Rows with a gain above
    `threshold` only."""
    by_name = {mem.name: mem for mem in portfolio.REGISTRY}
    gated = [frozenset(c.member for c in inst.cands if by_name[c.member].applies(inst.ctx.sit, settings)) | {SIM}
             for inst in insts]
    out = []
    for name in member_names(insts):
        if name == SIM:
            continue
        for (ds, n, m, dp), idx in _rows(insts).items():
            if not any(name not in gated[k] and any(c.member == name for c in insts[k].cands) for k in idx):
                continue
            gains = []
            bound = np.array([insts[k].bound_s for k in idx])
            for fallback in (False, True):
                base = np.array([insts[k].step(gated[k], fallback) for k in idx])
                wide = np.array([insts[k].step(gated[k] | {name}, fallback) for k in idx])
                gains.append(float(np.mean(base / bound) / np.mean(wide / bound)))
            if max(gains) > 1 + threshold:
                out.append(dict(member=name, dataset=ds, n=n, m=m, dp=dp, gain=gains[0], fb_gain=gains[1]))
    return pd.DataFrame(out, columns=["member", "dataset", "n", "m", "dp", "gain", "fb_gain"])
