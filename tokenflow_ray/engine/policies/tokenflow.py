"""TokenFlow (EuroSys '26, §4): buffer-aware preemptive scheduling in two steps.

Step 1, working set (Eq. 4-5): W_static = ⌊M/β⌋ streams, with M the KV blocks the working set may occupy (device
plus host spill store: paused streams live on the host, so the working set may exceed device memory) and β the
declared full-length footprint of a stream; W_scheduled = W_static − λ·(W_static − N) grows the working set from
its current size N towards W_static at a damped rate. It is also capped by capacity: the working set's Σ rates may
reach `overload_margin` × Γ (Γ: the decode capacity at the batch the device holds, cost_model.py); past that the
policy falls back to FCFS with memory-aware admission and admits nobody new (§4.3, Eq. 6).

Step 2, buffer balancing: streams are ranked by utility γ·e^(−b/T_critical) + v·t'/Δt (b: seconds of buffer the
reader holds, normalised as the paper's notes advise; t': time kept off the device; v: the value of the stream's
next token, its effective-throughput weight), higher rate breaking ties.
The greedy device set takes streams in that order while they fit; an adjacent-swap pass then trades a stream for
a smaller neighbour when that lets one more stream fit without displacing a buffer-critical one. A running
stream outside the set is paused only if its buffer covers the switch: b ≥ μ·(τ_evict + τ_load + τ_schedule).
The set is re-chosen every Δt, and only under stress (a stream waits, or some buffer is below T_critical).

The GPU regimes (issue 35; figures from the simulator, docs/results/simulator.md, tokenflow / fcfs, the
fields' values before them in `AS_BEFORE`, which the first H200 runs used):
- [departure] Ranking by tiers (`ranking`, `tier()`): who holds the device is decided first by need, then by
  utility: a due stream (never started, or paused with its reader's buffer under its lead μ·(resume + Δt)), a
  running stream whose next token has full value, a paused one whose would, then the streams ahead of their
  readers by seconds of buffer, a running one's counted at half.
  With the utility alone, a stream paused for one Δt outranked every running stream holding any buffer, so each
  rebalance swapped about half the device set and reloaded whole contexts: H200 (b) moved 8.6 TB from the host,
  raw 0.77x; by tiers 0.39 TB, raw 1.09x (P99 TTFT 0.044x either way). The price is effective throughput where
  the engine has capacity to spare (H200 (b): 3.15x -> 1.44x): streams run ahead of their readers, while the old
  rotation held every buffer low by throttling the engine with copies.
- [extension] A rebalance starts reloads for at most `switch_link_share` of the host link's time until the next
  one (`load_budget_blocks`): a reloading stream holds its blocks and decodes nothing until its last block lands.
- [departure] Γ from decode steps alone (`capacity_from`): the step-time fit over all steps spread the GPU engine's
  cold prefill steps (~61 ms a new prompt length) over its other terms, and its Γ swung from 0.5k to 3k tok/s in
  the first seconds of the H200 run; with one-off steps clipped (cost_model.py) it holds. With
  `overload_hysteresis` the fallback is left only at (1 − h)·margin·Γ: a Γ that moves by a few percent no longer
  flips the policy (each flip re-ranks every stream). On the 4090's Poisson (c) the two cut recompute 370k -> 106k
  tokens, raw 1.00x -> 1.06x.
- The FCFS fallback's memory-aware admission (§4.3; `growth_reserve`): admissions and resumes leave the running
  streams' growth until the next rebalance free. Without it the fallback packed the pool full and forced a stream
  out at every block boundary: the measured H200 engine, (a) at 1/8, P99 TTFT 1.08x -> 0.94x.
- [departure] Resume by reload unless a recompute is sooner by more than the batch it holds up
  (`resume_by_load`, `recompute_weight`).

Real traffic (issue 41; docs/results/real_traffic.md): replayed on the Azure conversation trace near capacity (the
first 10 minutes at 4x on the H200 profile), the policy above paused 9,046 streams where fcfs paused none, and made
TTFT mean 2.5x fcfs's and QoE 0.80 against 0.99. Near capacity the device pool is the binding resource and it turns
over by itself: a paused stream needs the same memory back before its reader runs dry, so each pause for a newcomer
was a swap, and the paused streams piled up on the host (350 at once) while new ones still waited. Two rules, from
the simulator's figures on that run (tokenflow / fcfs):
- [departure] Patience (`patience_s`, the scheduler's `_freed_by_finishing`): a rebalance pauses nobody for blocks
  and slots that running streams free by finishing within 2 s (each at its own recent pace). Preemptions 9,046 ->
  1,540, TTFT mean 1.72 -> 0.48 s (fcfs 0.68), QoE 0.80 -> 0.984 (fcfs 0.987), raw 0.94x -> 0.99x. 0.5 and 1 s
  barely move it (TTFT 1.70 and 1.35 s); 4-5 s pause almost no one (TTFT 0.64-0.73 s, QoE 0.980). Bursts of long
  streams (the paper's setups) have nothing finishing soon, so they pause as before. Not enough on other windows:
  minutes 10-20 at 4x paused 9,199 streams (QoE 0.78 against 0.94), minutes 40-50 read QoE 0.864 against 0.903.
- [departure] Newcomers wait while a paused stream is behind (`behind_leads`, `resumes_behind`): a rebalance
  pauses nobody for a new stream while some paused reader holds under two of its leads. Each pause for a newcomer
  was a swap the rotation had to undo: the paused streams piled up on the host (250 at once) while new ones still
  waited, since the memory a newcomer takes is held for seconds. On all six 10-minute windows of the hour at 3x and
  4x, with the simulator's planning overlapped as the CUDA engine runs it (sim/setups.py), every harm guard holds
  (QoE at or above fcfs's, TTFT mean at or below); minutes 10-20 at 4x: 651 pauses, QoE 0.962 against 0.946.
- [departure] Pacing holds no stream while another waits for the device (`pace_while_waiting`): a held stream keeps
  its blocks and computes nothing, so where memory binds it lengthens every stream's stay in the pool. With both
  rules but pacing while others wait: QoE 0.981, stall 0.33 s a stream (against 0.24 s). The price is effective
  throughput on the H200's (b) and (c), 1.58x -> 1.44x and 1.84x -> 1.25x, where raw rises 1.01x -> 1.09x and QoE
  stays 0.999 and 1.000: the tokens the old rule held back were worth nothing to effective throughput, not to readers.

[departure] Overload: the paper falls back at Σ rates > Γ. We fall back only at 2Γ by default: in a modest overload a
newcomer's first token costs one prefill, while waiting for a whole stream to finish costs it seconds (tens at the
paper's lengths), and buffer balancing shares the shortfall among all readers. Beyond 2Γ every reader would get
under half its rate; then FCFS serves the admitted ones well instead of all of them badly. The price is stall time:
in a sustained overload (the 4090's Poisson setups, 5-10x) the working set stays at 2Γ/r streams that each read at
half their rate, 30k s of stall against fcfs's 19 s, for P99 TTFT 0.68x.

[extension] Deadline-aware pacing (`pace`, on; pacing.py): a stream far ahead of its reader yields the device
for a step while it stays on schedule to finish by D, when a work-conserving engine at Γ would have finished.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenflow_ray.engine.policies.base import SchedulerView, SchedulingPolicy, arrival_key, waited_s
from tokenflow_ray.engine.policies.pacing import Pacer
from tokenflow_ray.engine.policies.tokenflow_config import TokenFlowConfig
from tokenflow_ray.engine.stream import Stream, StreamStatus
from tokenflow_ray.metrics.stream_metrics import effective_weight


class TokenFlowPolicy(SchedulingPolicy):
    name = "tokenflow"
    proactive = True
    uses_host_store = True

    def __init__(self, config: TokenFlowConfig | None = None) -> None:
        self.config = config or TokenFlowConfig()
        self._horizon = 0  # tokens a running stream adds before the next rebalance (growth_reserve)
        self._last_rebalance = -math.inf
        self.overloaded = False
        self.waiting = False  # some stream waits for the device (rank sets it each step)
        c = self.config
        self.pacer = Pacer(c.pace_buffer, c.pace_min_read_share, c.pace_slack)

    # ---- step 2: ranking ----------------------------------------------------------------------------------
    def utility(self, s: Stream, view: SchedulerView) -> float:
        """γ·e^(−b/T_critical) + v·t'/Δt, where v is the value of the stream's next token: the paper's
        effective-throughput weight at its current buffer (1 up to 10% of its length, 0 beyond 20%). A stream far
        ahead of its reader thus earns no credit for waiting until its buffer drains [interpretation of v_i]."""
        c = self.config
        if s.rate == 0:  # unpaced: no buffer to protect; the declared rate is only a hint, so rank as critical
            return c.gamma + waited_s(s, view.now) / c.delta_t
        penalty = math.exp(-s.buffer_s(view.now) / c.t_critical)
        return c.gamma * penalty + self._next_token_value(s, view) * waited_s(s, view.now) / c.delta_t

    def tier(self, s: Stream, view: SchedulerView) -> int:
        """Who holds the device, before anything else (ranking="tiers"): 4 a stream that is due (never started, or
        paused with its reader's buffer under its lead), 3 a running stream whose next token has full value (buffer
        under 10% of its length), 2 a paused stream whose next token would, 1 the streams ahead of that (their next
        token worth less). A running stream thus keeps its place until a due stream needs it or its tokens lose
        value while a paused one's would not: the set turns when readers need it, not every Δt."""
        if s.rate == 0:
            return 4
        running = s.status in (StreamStatus.RUNNING, StreamStatus.LOADING)
        if not running and (s.first_token_time is None or s.buffer_s(view.now) < self.lead_s(s, view)):
            return 4
        if self._next_token_value(s, view) < 1.0:
            return 1
        return 3 if running else 2

    def within_tier(self, s: Stream, view: SchedulerView) -> float:
        """The order inside a tier, lower first: −utility, except among streams ahead of their readers (tier 1),
        which go by seconds of buffer with a running stream's counted at half: a paused one takes its place only
        when its reader holds under half as much (a reader whose rate went up, say), not whenever buffers cross."""
        if s.rate > 0 and self.tier(s, view) == 1:
            return s.buffer_s(view.now) * (0.5 if s.status in (StreamStatus.RUNNING, StreamStatus.LOADING) else 1.0)
        return -self.utility(s, view)

    def lead_s(self, s: Stream, view: SchedulerView) -> float:
        """How long before its reader runs dry a paused stream must be chosen to come back in time: μ x (its
        resume, by reload or recompute, + the wait for the next rebalance)."""
        cost = view.cost
        resume = min(cost.t_copy(view.blocks(s.num_tokens)), cost.t_recompute(s.num_tokens))
        return self.config.mu * (resume + self.config.delta_t)

    def capacity(self, view: SchedulerView) -> float:
        """Γ at the batch the device can hold, from the step-time model: not the batch this policy chose to run,
        which would make a policy that runs few streams measure little capacity and keep running few."""
        if self.config.capacity_from == "decode_steps":
            return view.cost.decode_step_capacity_tok_s(view.max_device_batch)
        return view.cost.decode_capacity_tok_s(view.max_device_batch)

    def rank(self, streams: Sequence[Stream], view: SchedulerView) -> list[Stream]:
        c = self.config
        limit = c.overload_margin * self.capacity(view)
        # Past margin x Γ the fallback holds until the demand is back under (1 - hysteresis) of it: a Γ that moves
        # by a few percent must not flip the policy (each flip re-ranks every stream and churns the device set).
        self.overloaded = view.sum_rate > (limit * (1 - c.overload_hysteresis) if self.overloaded else limit)
        self.reserve_on_resume = c.growth_reserve and self.overloaded
        if c.growth_reserve:
            self._horizon = min(view.block_size, max(1, math.ceil(c.delta_t / max(view.cost.step_s, 1e-4))))
        if c.pace and not c.pace_while_waiting:  # only hold() reads it: no pass over the streams otherwise
            self.waiting = any(s.status in (StreamStatus.WAITING, StreamStatus.PREEMPTED) for s in streams)
        if c.pace:
            self.pacer.track(streams, view.now, self.capacity(view), view.cost.step_s, active=not self.overloaded)
        if self.overloaded:
            return sorted(streams, key=arrival_key)
        if c.ranking == "tiers":
            return sorted(streams, key=self._tiered_key(view))
        return sorted(streams, key=self._rank_key(view))

    def _rank_key(self, view: SchedulerView):
        """The ranking's sort key, (−utility, −rate, arrival, id), with `utility` written out: it runs for
        every live stream every step, so each reader's buffer is read once and the waiting credit v·t'/Δt is
        computed only for a stream kept off the device (on it t' = 0 and the term is 0.0). Same values as
        `utility`: keep the two in step (tests/engine/test_rank_keys.py compares them)."""
        c = self.config
        now, gamma, t_critical, delta_t, exp = view.now, c.gamma, c.t_critical, c.delta_t, math.exp
        on_device = (StreamStatus.RUNNING, StreamStatus.LOADING)

        def key(s: Stream) -> tuple:
            rate = s.rate
            if s.status in on_device:
                waited = 0.0
            else:  # waited_s
                waited = now - (s.last_preempted_at if s.record.preemptions else s.arrival_time)
                if not waited > 0.0:
                    waited = 0.0
            if rate == 0:
                utility = gamma + waited / delta_t
            else:
                reader = s.reader
                buffered = reader.buffer_at(now)
                r = reader.rate
                utility = gamma * exp(-(buffered / r if r > 0 else 0.0) / t_critical) + (
                    effective_weight(buffered, s.sampling.max_tokens) * waited / delta_t if waited else 0.0)
            return (-utility, -rate, s.arrival_time, s.stream_id)

        return key

    def _tiered_key(self, view: SchedulerView):
        """rank()'s key for ranking="tiers": (−tier, within_tier, −rate, arrival), the reader queried once per
        stream and the step's costs read once (rank runs every step over every live stream): what `tier`,
        `within_tier` and `utility` compute, fused."""
        c, cost, now = self.config, view.cost, view.now
        gamma, t_crit, dt, mu, bs = c.gamma, c.t_critical, c.delta_t, c.mu, view.block_size
        block_s = cost.block_bytes / cost.copy_bytes_per_s
        fit = cost.fit
        chunk, fixed, per_token = cost.prefill_chunk_tokens, fit.fixed_s, fit.prefill_s
        active = (StreamStatus.RUNNING, StreamStatus.LOADING)
        exp = math.exp

        def resume_s(n: int) -> float:
            return min(-(-n // bs) * block_s, -(-n // chunk) * fixed + n * per_token)

        def key(s: Stream) -> tuple:
            rate = s.rate
            waited = waited_s(s, now)
            if rate == 0:
                return (-4, -(gamma + waited / dt), 0.0, s.arrival_time, s.stream_id)
            tokens = s.reader.buffer_at(now)
            b = tokens / rate
            length = s.sampling.max_tokens
            value = 1.0 if tokens <= 0.1 * length else max(0.0, (0.2 * length - tokens) / (0.1 * length))
            running = s.status in active
            if running:
                tier = 3 if value >= 1.0 else 1
            elif s.first_token_time is None:
                tier = 4
            else:
                tier = 4 if b < mu * (resume_s(s.num_tokens) + dt) else (2 if value >= 1.0 else 1)
            if tier == 1:
                return (-1, b * 0.5 if running else b, -rate, s.arrival_time, s.stream_id)
            return (-tier, -(gamma * exp(-b / t_crit) + value * waited / dt), -rate, s.arrival_time, s.stream_id)

        return key

    @property
    def rebalance_interval_s(self) -> float:
        return self.config.delta_t

    def should_rebalance(self, streams: Sequence[Stream], view: SchedulerView) -> bool:
        if self.overloaded:
            return False
        if view.now - self._last_rebalance < self.config.delta_t:
            # A new stream does not wait for the next Δt while pacing holds streams that could make room for it.
            if not (self.pacer.active and any(s.status == StreamStatus.WAITING and s.first_token_time is None
                                         for s in streams)):
                return False
        stressed = any(s.status in (StreamStatus.WAITING, StreamStatus.PREEMPTED) or (
            s.rate > 0 and s.first_token_time is not None and s.buffer_s(view.now) < self.config.t_critical)
            for s in streams)
        if stressed:
            self._last_rebalance = view.now
        return stressed

    def hold(self, running: Sequence[Stream], view: SchedulerView) -> set[str]:
        """The running streams pacing holds back this step (pacing.py), each one the rebalance may pause: a held
        stream that could not be paused would sit on a slot and blocks that a waiting stream needs while computing
        nothing (a burst of 40 streams into 16 slots idled ~50 steps so). Their readers hold over 20% of their
        length, so they rank in the lowest tier, by buffer: the first paused when others need the device."""
        if not self.config.pace or (self.waiting and not self.config.pace_while_waiting):
            return set()
        now = view.now
        return {s.stream_id for s in self.pacer.candidates(running, now) if self.may_preempt(s, view)}

    def patience_s(self, view: SchedulerView) -> float:
        return self.config.patience_s

    def resumes_behind(self, paused: Sequence[Stream], view: SchedulerView) -> bool:
        """A paused stream whose reader holds under `behind_leads` of its leads: it needs the device back within
        about one more lead, and the memory a new stream would take is held for seconds (its prefill and its
        first buffer), so that stream would be one more reader the rotation cannot bring back in time."""
        leads = self.config.behind_leads
        if leads <= 0:
            return False
        now = view.now
        return any(s.rate > 0 and s.first_token_time is not None and s.buffer_s(now) < leads * self.lead_s(s, view)
                   for s in paused)

    def _next_token_value(self, s: Stream, view: SchedulerView) -> float:
        return effective_weight(s.reader.buffer_at(view.now), s.sampling.max_tokens)

    def switch_cost_s(self, s: Stream, view: SchedulerView) -> float:
        cost = view.cost
        evict = cost.t_copy(max(1, view.blocks(s.num_computed_tokens) - s.num_host_tokens // view.block_size))
        load = min(cost.t_copy(view.blocks(s.num_tokens)), cost.t_recompute(s.num_tokens))
        return evict + load + self.config.delta_t

    def resume_by_load(self, stream: Stream, t_io: float, t_recompute: float, view: SchedulerView) -> bool:
        """Reload whenever the reader's buffer covers the reload; otherwise reload unless a recompute is sooner by
        more than the batch it holds up (paper §4.2.3: the sooner of the two).

        [departure] The paper recomputes whenever t_IO > t_recompute. But a recompute spends the device's compute,
        which every running stream's next token waits on, while a reload spends only the copy link beside it (and
        the reloading stream's own blocks); and the queue-aware t_IO is long exactly when many streams resume at
        once. With the paper's rule the H200 profile recomputed 14x its setup's output and ran at 0.33-0.40x fcfs's
        raw throughput (the simulator's H200 rows before the resume fix, commit 86b8605); a reload the buffer
        hides costs the reader nothing. When the buffer does not cover it (deep overload: every buffer is empty),
        `recompute_weight="batch"` weighs the recompute by the batch it delays, t_IO <= B·t_recompute with B the
        streams the device holds: on the measured H200 engine, (a) at 1/8, the stream-alone rule still recomputed
        40k tokens (376k of 208k output when new shapes cost nothing) and this one none, raw 0.81x -> 0.87x."""
        if stream.rate > 0 and t_io <= stream.buffer_s(view.now):
            return True
        if self.config.recompute_weight == "batch":
            return t_io <= view.max_device_batch * t_recompute
        return t_io <= t_recompute

    def may_preempt(self, stream: Stream, view: SchedulerView) -> bool:
        if stream.rate == 0:
            return False
        return stream.buffer_s(view.now) >= self.config.mu * self.switch_cost_s(stream, view)

    # ---- step 1: working set ------------------------------------------------------------------------------
    def load_budget_blocks(self, view: SchedulerView) -> float:
        """The rotation rate against the copy budget: the reloads one rebalance starts may take at most
        `switch_link_share` of the host link's time until the next one. A reloading stream holds its device blocks
        and decodes nothing until its last block lands, and the reloads queue behind one another."""
        share = self.config.switch_link_share
        if share is None:
            return float("inf")
        cost = view.cost
        return max(1.0, share * self.config.delta_t * cost.copy_bytes_per_s / cost.block_bytes)

    def reserve_tokens(self, running: Sequence[Stream]) -> int:
        """The FCFS fallback's memory-aware admission (growth_reserve, paper §4.3): the running streams' growth
        until the next rebalance stays free, so a resume or an admission does not force a stream out at the next
        block boundary. Outside the fallback a stream that needs room gets it from the rebalance, which pauses
        the running streams with the most buffer: holding memory back there only delays newcomers."""
        if not (self.config.growth_reserve and self.overloaded):
            return 0
        return sum(self.growth_tokens(s) for s in running)

    def growth_tokens(self, stream: Stream) -> int:
        if not (self.config.growth_reserve and self.overloaded):
            return 0
        return min(self._horizon, max(0, stream.sampling.max_tokens - stream.num_output_tokens))

    def admission_limit(self, view: SchedulerView) -> float:
        if self.overloaded:  # FCFS fallback: no new streams parked beside the ones already admitted
            return max(view.num_working, 1)
        return self.working_set_target(view)

    def working_set_target(self, view: SchedulerView) -> float:
        """W_scheduled (Eq. 4-5), capped so the working set's Σ rates stay within overload_margin × Γ."""
        w_static = math.floor((view.device_blocks + view.host_blocks) / max(view.mean_full_blocks, 1.0))
        n = view.num_working
        w_sched = w_static - self.config.lam * (w_static - n) if n < w_static else float(w_static)
        if view.mean_rate > 0:
            w_sched = min(w_sched, self.config.overload_margin * self.capacity(view) / view.mean_rate)
        return max(w_sched, 1.0)  # an empty working set always takes one stream: never a deadlock

    def refine(self, chosen: list[Stream], ranked: Sequence[Stream], view: SchedulerView) -> list[Stream]:
        """Adjacent swaps at the set's edge: a stream gives its place to its smaller next neighbour when that lets
        one more stream fit, unless it is buffer-critical."""
        def need(s: Stream) -> int:
            return view.blocks(s.num_tokens + 1)

        members = {s.stream_id for s in chosen}
        used = sum(need(s) for s in chosen)
        for i in range(len(ranked) - 1):
            a, b = ranked[i], ranked[i + 1]
            if a.stream_id not in members or b.stream_id in members or need(b) >= need(a):
                continue
            if a.rate == 0 or a.buffer_s(view.now) < self.config.t_critical or len(members) >= view.max_num_seqs:
                continue
            after = used - need(a) + need(b)
            extra = next((c for c in ranked[i + 2:] if c.stream_id not in members
                          and after + need(c) <= view.device_blocks), None)
            if extra is not None:
                members.discard(a.stream_id)
                members.update((b.stream_id, extra.stream_id))
                used = after + need(extra)
        return [s for s in ranked if s.stream_id in members]
