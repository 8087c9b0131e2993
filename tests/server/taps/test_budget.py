"""The overhead budget's arithmetic (``taps.budget``) with a fake clock and simulated passes.

Each simulated pass runs the real per-pass decision (``PassDecisions.decide``,
which applies the governor's stride) and charges each tap what it would cost:
``cost`` on a sampled pass, ``floor`` otherwise (its nonfinite part, if any).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layertap.server.host.context import PassContext
from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.taps.budget import MAX_STRIDE, WINDOW_SECONDS, Governor, fair_shares, share_key
from layertap.server.taps.pass_decision import PassDecisions
from layertap.server.taps.sampling import Sampler
from layertap.server.taps.tap import SERVER_OWNER, Tap
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

MOMENTS = pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS)
NONFINITE = pb.ReducerSpec(kind=pb.REDUCER_KIND_NONFINITE)


def make_tap(tap_id: str, owner: str = "alice", every: int = 1, nonfinite: bool = False,
             layer: str | None = None) -> Tap:
    """A tap on ``layer`` (its own, named as it is, unless given: taps on one layer share reductions)."""
    reducers = build_reducers([MOMENTS, NONFINITE] if nonfinite else [MOMENTS], "reducers")
    plan = ReducerPlan(reducers)
    layer = layer or tap_id
    sampling = pb.Sampling(every_n=every)
    tap = Tap(tap_id, pb.TapSpec(selector=layer, sampling=sampling), pb.TAP_KIND_DURABLE, [layer], plan,
              plan.nonfinite_only(), Sampler(sampling), 0.0)
    tap.owner, tap.governed = owner, owner != SERVER_OWNER  # as TapEngine.create
    return tap


class Sim:
    """Passes of a model whose forward takes ``base`` seconds, plus what the taps cost."""

    def __init__(self, budget: float, base: float = 4e-3) -> None:
        self.now = 0.0
        self.governor = Governor(budget, clock=lambda: self.now)
        self.decisions = PassDecisions()
        self.base = base
        self.index = 0
        self.cost: dict[str, float] = {}
        self.floor: dict[str, float] = {}
        self.taps: list[Tap] = []
        #: Per pass: (hook seconds, pass seconds), and each tap's sampled passes and nonfinite passes.
        self.passes: list[tuple[float, float]] = []
        self.sampled: dict[str, int] = {}
        self.counted: dict[str, int] = {}

    def add(self, tap: Tap, cost: float, floor: float = 0.0) -> Tap:
        self.taps.append(tap)
        self.cost[tap.id], self.floor[tap.id] = cost, floor
        return tap

    def run(self, passes: int) -> None:
        for _ in range(passes):
            ctx = PassContext(self.index)
            self.index += 1
            hook = 0.0
            reduced: set[object] = set()  # as taps.reuse: a reduction an equal tap ran this pass is shared
            for tap in self.taps:
                self.decisions.decide(tap, ctx)
                spent = self.cost[tap.id] if tap._sampled else self.floor[tap.id] if tap._on else 0.0
                if tap._sampled:
                    spent = 0.0 if share_key(tap) in reduced else spent
                    reduced.add(share_key(tap))
                tap._spent += spent
                hook += spent
                self.sampled[tap.id] = self.sampled.get(tap.id, 0) + tap._sampled
                self.counted[tap.id] = self.counted.get(tap.id, 0) + (tap._on and tap.always is not None)
            self.decisions.pass_ended()
            seconds = self.base + hook
            self.now += seconds
            self.passes.append((hook, seconds))
            self.governor.pass_ended(seconds, hook, lambda: list(self.taps))

    def share(self, last: int) -> float:
        tail = self.passes[-last:]
        return sum(h for h, _ in tail) / sum(s for _, s in tail)

    def reset_counts(self) -> None:
        self.sampled.clear()
        self.counted.clear()


def windows(seconds: float, base: float = 4e-3) -> int:
    """Passes in about ``seconds`` of a model whose passes take ``base``."""
    return int(seconds / base)


def test_max_min_fair_shares_by_hand() -> None:
    assert fair_shares(10.0, [1.0, 2.0, 20.0, 30.0]) == [1.0, 2.0, 3.5, 3.5]
    assert fair_shares(10.0, [1.0, 2.0]) == [1.0, 2.0]  # room to spare: everyone gets what it asks
    assert fair_shares(0.0, [1.0, 2.0]) == [0.0, 0.0]


@given(st.floats(0, 100, allow_subnormal=False), st.lists(st.floats(0, 100, allow_subnormal=False), max_size=12))
def test_fair_shares_never_exceed_the_total_or_a_demand_and_leave_nothing_wanted_unused(
        total: float, demands: list[float]) -> None:
    shares = fair_shares(total, demands)
    assert all(0 <= s <= d * (1 + 1e-12) + 1e-12 for s, d in zip(shares, demands))
    assert sum(shares) <= total * (1 + 1e-9) + 1e-12
    # Max-min: whoever gets less than it asked gets at least as much as anyone else.
    short = [s for s, d in zip(shares, demands) if s < d * (1 - 1e-9)]
    if short:
        assert min(short) >= max(shares) * (1 - 1e-9)
        assert sum(shares) >= total * (1 - 1e-9)  # and the whole total is handed out


def test_thirty_taps_over_the_budget_are_thinned_until_the_share_is_under_it() -> None:
    sim = Sim(budget=0.05)
    for i in range(30):
        sim.add(make_tap(f"t{i}"), cost=1e-3)  # 30 ms of hooks on a 4 ms pass: 88% of pass time
    sim.run(8)
    assert sim.share(8) > 0.5 and all(t.throttle == 1 for t in sim.taps)  # the first window runs at full rate
    sim.run(windows(3.0))
    assert sim.share(windows(1.0)) <= 0.05
    assert all(t.throttle > 1 for t in sim.taps)
    assert all("--tap-budget 0.05" in t.throttle_reason and f"1 in {t.throttle}" in t.throttle_reason
               for t in sim.taps)
    assert sim.governor.throttled == 30 and sim.governor.share <= 0.05
    sim.reset_counts()
    sim.run(windows(2.0))
    assert all(sim.sampled[t.id] > 0 for t in sim.taps)  # thinned, never starved


def test_the_rate_comes_back_when_the_load_falls() -> None:
    sim = Sim(budget=0.05)
    taps = [sim.add(make_tap(f"t{i}"), cost=1e-3) for i in range(10)]
    sim.run(windows(3.0))
    assert all(t.throttle > 1 for t in taps)
    sim.taps = taps[:1]  # nine clients leave: one tap of 1 ms on a 4 ms pass is still over 5%...
    sim.base = 40e-3  # ...but the model now runs batches ten times longer: 1 ms is 2.4% of a pass
    sim.run(windows(3.0, base=40e-3))
    assert taps[0].throttle == 1 and taps[0].throttle_reason == ""
    assert sim.governor.throttled == 0


def test_principals_share_fairly_and_the_cheap_tap_keeps_every_pass() -> None:
    sim = Sim(budget=0.10)
    heavy = [sim.add(make_tap(f"a{i}", owner="alice"), cost=2e-3) for i in range(10)]
    light = sim.add(make_tap("b", owner="bob"), cost=0.1e-3)
    sim.run(windows(4.0))
    assert light.throttle == 1
    assert all(t.throttle > 1 for t in heavy)
    sim.reset_counts()
    n = windows(2.0)
    sim.run(n)
    assert sim.sampled["b"] == n  # bob's one cheap tap: every pass
    alice = sum(sim.sampled[t.id] * 2e-3 for t in heavy) / n
    # alice gets the rest of the budget, not more: her spend and bob's stay within it, and use most of it.
    budget = 0.10 * sum(s for _, s in sim.passes[-n:]) / n
    assert 0.5 * budget <= alice + 0.1e-3 <= budget


def test_one_principal_cannot_take_the_budget_from_another() -> None:
    sim = Sim(budget=0.10)
    hog = [sim.add(make_tap(f"a{i}", owner="alice"), cost=3e-3) for i in range(20)]
    other = [sim.add(make_tap(f"b{i}", owner="bob"), cost=1e-3) for i in range(2)]
    sim.run(windows(4.0))
    sim.reset_counts()
    n = windows(2.0)
    sim.run(n)
    spend = {owner: sum(sim.sampled[t.id] * sim.cost[t.id] for t in taps) / n
             for owner, taps in (("alice", hog), ("bob", other))}
    # Each asks for far more than half; each gets about half (strides are whole numbers: never above half).
    assert spend["bob"] >= 0.5 * spend["alice"]
    assert spend["alice"] <= 1.05 * spend["bob"] * (1 + 1 / min(t.throttle for t in other))


def test_a_thinned_tap_with_nonfinite_still_counts_every_pass_and_samples_exactly_its_stride() -> None:
    sim = Sim(budget=0.05)
    tap = sim.add(make_tap("t", nonfinite=True), cost=2e-3, floor=0.01e-3)
    sim.run(windows(3.0))
    stride = tap.throttle
    assert stride > 1
    sim.reset_counts()
    n = 50 * stride
    sim.run(n)
    assert sim.counted["t"] == n  # nonfinite on every pass
    assert tap.throttle == stride or pytest.fail("the stride moved: a steady load must give a steady stride")
    assert sim.sampled["t"] == n // stride  # 1 in `stride` exactly: the thinning is deterministic


def test_always_on_parts_that_alone_exceed_the_budget_are_thinned_too_and_say_so() -> None:
    """Thirty taps' nonfinite on every pass (0.2 ms each: 6 ms on a 4 ms pass) is no longer "the cheap
    part": it is thinned too, after every sampled pass, and each tap's reason says both strides."""
    sim = Sim(budget=0.05)
    taps = [sim.add(make_tap(f"t{i}", nonfinite=True), cost=1e-3, floor=0.2e-3) for i in range(30)]
    sim.run(windows(4.0))
    assert sim.share(windows(1.0)) <= 0.05
    assert all(t.throttle > 1 and t.cost.always_stride > 1 for t in taps)
    assert all("always-on part" in t.throttle_reason for t in taps)
    sim.reset_counts()
    n = windows(2.0)
    sim.run(n)
    assert all(0 < sim.counted[t.id] < n for t in taps)  # on some passes, not all


def test_a_tap_sampling_every_tenth_pass_is_charged_a_tenth_of_its_cost() -> None:
    """Its own sampling already cuts its spend: the budget charges the demand at its own rate."""
    sim = Sim(budget=0.05)
    sparse = sim.add(make_tap("sparse", every=10), cost=1.5e-3)  # 0.15 ms a pass: under 5% of 4 ms
    sim.run(windows(3.0))
    assert sparse.throttle == 1
    sim.taps = [dense := sim.add(make_tap("dense"), cost=1.5e-3)]  # the same cost on every pass: 1.5 ms, over it
    sim.run(windows(3.0))
    assert dense.throttle > 1


def test_the_servers_own_taps_are_never_thinned_and_leave_the_rest_less_room() -> None:
    """--taps files and drift baselines (owner SERVER_OWNER): operator-made, calibrated on their sampling."""
    sim = Sim(budget=0.05)
    baseline = sim.add(make_tap("baseline", owner=SERVER_OWNER), cost=0.15e-3)  # 3.6% of a 4.15 ms pass
    client = sim.add(make_tap("client"), cost=0.15e-3)
    sim.run(windows(4.0))
    assert baseline.throttle == 1 and baseline.throttle_reason == ""
    assert client.throttle > 1  # alone it would fit (3.6%); beside the baseline, only in part
    sim.reset_counts()
    n = windows(2.0)
    sim.run(n)
    assert sim.sampled["baseline"] == n
    assert sim.share(n) <= 0.05


def test_a_budget_of_zero_never_thins() -> None:
    sim = Sim(budget=0.0)
    taps = [sim.add(make_tap(f"t{i}"), cost=1e-3) for i in range(30)]
    sim.run(windows(2.0))
    assert all(t.throttle == 1 for t in taps) and sim.governor.throttled == 0
    assert sim.governor.share > 0.5  # measured all the same


def test_a_tap_that_costs_more_than_the_whole_budget_at_the_sparsest_stride_still_gets_its_sparsest() -> None:
    sim = Sim(budget=0.01)
    tap = sim.add(make_tap("huge"), cost=10.0)  # ten seconds a sampled pass
    sim.run(windows(WINDOW_SECONDS * 3))
    assert tap.throttle == MAX_STRIDE


@pytest.mark.parametrize("budget", [-0.1, 1.0, float("nan")])
def test_a_budget_outside_zero_to_one_is_refused(budget: float) -> None:
    with pytest.raises(ValueError, match="tap budget"):
        Governor(budget)


def test_identical_taps_are_thinned_as_one_and_sample_the_same_passes() -> None:
    """Thirty subscribers asking for the same reductions of one layer share them (``taps.reuse``): the
    group pays once a pass, so it is thinned as one tap with thirty shares, all members in step."""
    sim = Sim(budget=0.05)
    same = [sim.add(make_tap(f"s{i}", owner=f"user{i % 3}", layer="shared"), cost=1e-3) for i in range(30)]
    sim.run(windows(3.0))
    assert sim.share(windows(1.0)) <= 0.05
    strides = {t.throttle for t in same}
    # 1 ms a sampled pass against 0.2 ms of budget: about 1 in 5 (thinned alone, each would be ~1 in 150).
    assert len(strides) == 1 and 2 <= strides.pop() <= 10
    assert all("shared by 30 taps" in t.throttle_reason for t in same)
    sim.reset_counts()
    passes = {t.id: [] for t in same}
    for _ in range(40):
        sim.run(1)
        for t in same:
            if t._sampled:
                passes[t.id].append(sim.index)
    assert all(p == passes["s0"] for p in passes.values()) and passes["s0"]  # in step, never starved


def test_the_scale_learns_what_taps_cost_against_their_estimates() -> None:
    sim = Sim(budget=0.05)
    taps = [sim.add(make_tap(f"t{i}"), cost=40e-6) for i in range(3)]
    for tap in taps:
        tap.cost.estimate = 10e-6  # the plan's estimate; live passes cost four times that
    sim.run(windows(5.0))
    assert sim.governor.scale == pytest.approx(4.0, rel=0.05)
    assert sim.governor.per_pass == pytest.approx(4e-3 + 120e-6, rel=0.05)


def test_taps_that_sample_on_passes_of_their_own_are_not_grouped() -> None:
    every, plain = make_tap("a", layer="l", every=3), make_tap("b", layer="l")
    assert share_key(every) != share_key(make_tap("c", layer="l", every=3))  # each counts from its birth
    assert share_key(plain) == share_key(make_tap("d", layer="l"))
    assert share_key(plain) != share_key(make_tap("e", layer="other"))


def test_the_scale_is_bounded_when_a_tap_measures_nothing() -> None:
    """A tap that reuses the server's own reduction measures ~0 against its estimate: the scale stops at 1/4."""
    sim = Sim(budget=0.05)
    tap = sim.add(make_tap("t"), cost=1e-9)
    tap.cost.estimate = 50e-6
    sim.run(windows(10.0))
    assert sim.governor.scale == pytest.approx(0.25, rel=0.01)


def test_what_subscribers_threads_spend_delivering_a_taps_summaries_counts_against_it() -> None:
    """Building and serializing a tap's summaries on subscribers' stream threads (``rpc.taps.deliver``)
    holds the same GIL as the model: a tap cheap in its hooks but dear to deliver is thinned too."""
    sim = Sim(budget=0.05)
    cheap, dear = sim.add(make_tap("cheap"), cost=10e-6), sim.add(make_tap("dear"), cost=10e-6)
    for _ in range(windows(3.0)):
        sim.run(1)
        if dear._sampled:
            dear.deliver(1e-3, always=False)  # 1 ms of its subscribers' threads for each pass it samples
    assert cheap.throttle == 1 and dear.throttle > 1
    assert dear.delivered_seconds > 0 and dear.delivered_always_seconds == 0


def test_a_cost_that_lands_a_window_after_its_pass_keeps_the_tap_thinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled pass's publishing and delivery land later, often in the next window, whose own sampled
    passes (if any) then carry it. Taken window by window, the window holding the sampled pass saw its
    hook time alone and the stride fell back; the governor keeps a cost until later windows show it fell."""

    def spend(fall: float) -> float:
        monkeypatch.setattr("layertap.server.taps.budget._COST_FALL", fall)
        sim = Sim(budget=0.05)
        tap = sim.add(make_tap("wide"), cost=20e-6)
        late: list[int] = []  # passes at which a sampled pass's 20 ms of delivery lands
        delivered: list[float] = []
        for i in range(windows(30.0)):
            sim.run(1)
            if tap._sampled:
                late.append(i + 140)  # past the end of the next window (125 passes of 4 ms)
            due = sum(1 for d in late if d == i)
            tap.deliver(20e-3 * due, always=False)
            delivered.append(20e-3 * due)
        tail = windows(20.0)
        time = sum(s for _, s in sim.passes[-tail:])
        return (sum(h for h, _ in sim.passes[-tail:]) + sum(delivered[-tail:])) / time

    assert spend(0.25) <= 0.05 * 1.2  # near the budget (the gain trims what remains)
    assert spend(1.0) > 0.05 * 1.5  # window by window: well over it
