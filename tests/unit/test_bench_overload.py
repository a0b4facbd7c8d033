"""The overload benchmark's arithmetic: the mix, and goodput and success per phase."""

import asyncio
import math
import os

import pytest

from loadtest import machine_speed
from loadtest.bench_overload import (
    DEFAULT_MIX,
    MULTIPLES,
    Outcome,
    Phase,
    bench_config,
    bounded_queue,
    check_targets,
    criticality_sequence,
    feasible_shares,
    machine_adjusted,
    machine_ratio,
    measure_capacity,
    refusal_cpu_ms,
    share_of_feasible,
)
from loadtest.machine_speed import SpeedProbeProcess


def test_the_criticality_sequence_is_seeded_and_follows_the_mix():
    a = criticality_sequence(20000, DEFAULT_MIX, seed=3)
    assert a == criticality_sequence(20000, DEFAULT_MIX, seed=3)
    assert a != criticality_sequence(20000, DEFAULT_MIX, seed=4)
    for crit, share in DEFAULT_MIX.items():
        assert abs(a.count(crit) / len(a) - share) < 0.015
    # Critical traffic at 4 C stays within C: the target is reachable at all.
    assert 4 * (DEFAULT_MIX["critical_plus"] + DEFAULT_MIX["critical"]) <= 1.0


def test_goodput_counts_only_answers_within_the_slo():
    p = Phase(rate=10.0, duration_s=2.0, slo_s=1.0)
    p.outcomes = [
        Outcome("critical", 200, "OK", 0.2),
        Outcome("critical", 200, "OK", 1.5),  # answered, but too late: not good
        Outcome("sheddable", 503, "OVERLOADED", 0.01),
        Outcome("sheddable", 0, "ReadTimeout", 10.0),
        Outcome("critical_plus", 200, "OK", 0.9),
    ]
    assert p.good() == 2
    assert p.goodput() == 1.0
    assert p.good_fraction("critical") == 0.5
    assert p.good_fraction("sheddable") == 0.0
    assert math.isnan(p.good_fraction("sheddable_plus"))
    assert p.admitted_p99_ms() == 1500.0  # admitted = answered 200, however late
    assert p.answer_p99_ms() == 1500.0  # every answer; the one with none (status 0) is not one
    assert p.codes()["OK"] == 3


def test_the_bench_tenant_has_no_token_quota_and_its_own_key():
    cfg = bench_config("cluster/local.yaml")
    key = next(k for k, t in cfg.auth.demo_keys.items() if t == "bench")
    assert key and cfg.tenants["bench"].rate_tokens_per_s is None
    assert cfg.tenants["bench"].max_criticality.value == "critical_plus"


def test_the_bench_fixes_the_model_replica_count():
    cfg = bench_config("cluster/local.yaml")
    m = cfg.deployments.model
    assert (m.min_replicas, m.max_replicas) == (1, 1)
    m = bench_config("cluster/local.yaml", model_replicas=2).deployments.model
    assert (m.min_replicas, m.max_replicas, m.initial_replicas) == (2, 2, 2)


def test_the_engine_core_pins_the_built_in_model_and_only_then():
    assert bench_config("cluster/local.yaml").model.cpus is None
    assert bench_config("cluster/local.yaml", cpus=[1]).model.cpus == [1]


def test_level_reasons_are_grouped_without_their_numbers():
    from loadtest.bench_overload import reason_kind

    assert reason_kind("up 2->3: error_rate=0.109005>=0.1 (n=211)") == "up 2->3: error_rate"
    assert reason_kind("hold 1: target 0 (normal) for 4.5s of 30s") == "hold 1: target 0 (normal)"
    assert reason_kind("normal") == "normal" and reason_kind(None) is None


def test_a_sample_is_the_one_models_view_and_nothing_for_several():
    from loadtest.bench_overload import one_model

    doc = {
        "models": {"m": {"level": 2, "gate": {"limit": 8}, "breakers": {"primary": {"state": "closed"}}}},
        "snapshot": {"models": {"m": {"level": 2, "reason": "up 1->2: queue_length=120>=100"}}},
    }
    view = one_model(doc)
    assert (view["level"], view["gate"], view["controller"]["reason"]) == (
        2,
        {"limit": 8},
        doc["snapshot"]["models"]["m"]["reason"],
    )
    assert one_model({"models": {"a": {"level": 0}, "b": {"level": 1}}}) == {}  # no model is "the" one
    assert one_model({}) == {}


def test_the_trace_groups_outcomes_by_second_of_sending():
    from loadtest.bench_overload import format_trace

    p = Phase(rate=4.0, duration_s=2.0, slo_s=1.0)
    p.outcomes = [
        Outcome("critical", 200, "OK", 0.2, 0.1),
        Outcome("critical", 200, "OK", 1.4, 0.6),  # late: a miss with no code of its own
        Outcome("sheddable", 503, "OVERLOADED", 0.01, 0.9),
        Outcome("critical_plus", 503, "OVERLOADED", 0.01, 1.2),
        Outcome("sheddable", 200, "OK", 0.3, 1.7),
    ]
    p.trace = [
        {"_t": 0.1, "level": 0, "gate": {"limit": 8, "waiting": 0, "refused": {"drain": 5}}},  # before the phase
        {"_t": 0.4, "level": 0, "gate": {"limit": 8, "waiting": 0, "refused": {"drain": 6}}},
        {
            "_t": 1.5,
            "level": 1,
            "gate": {
                "limit": 6,
                "ceiling": 14,
                "rows_curve": {"rows": 11},
                "wait_p90_ms": {"critical_plus": 42.5, "critical": 310.0},
                "decreases_by": {"slow": 1},
                "refused": {"drain": 8, "expired": 0},
            },
        },
    ]
    p.send_lags = [(0.1, 0.002), (0.6, 0.35), (1.2, 0.004)]  # the generator stalled around 0.6 s
    rows = p.per_second()
    assert [r["lag_ms"] for r in rows] == pytest.approx([350.0, 4.0])
    assert [(r["s"], r["sent"], r["good"], r["crit"], r["crit_good"]) for r in rows] == [
        (0, 3, 1, 2, 1),
        (1, 2, 1, 1, 0),
    ]
    assert rows[0]["crit_miss"] == {"LATE": 1} and rows[1]["crit_miss"] == {"OVERLOADED": 1}
    assert rows[0]["status"]["level"] == 0 and rows[1]["status"]["level"] == 1
    text = format_trace(p)
    assert "LATE:1" in text and "OVERLOADED:1" in text and len(text.splitlines()) == 3
    assert text.splitlines()[1].endswith("| drain:1")
    last = text.splitlines()[-1]
    assert last.endswith("OVERLOADED:1 | slow:1 | drain:2")  # since the line before; zero deltas left out
    assert last.split()[4:8] == ["1", "6", "14", "11"]  # level, limit, ceiling, the rows curve's knee
    assert text.splitlines()[1].split()[4:8] == ["0", "8", "-", "-"]  # none known
    assert text.splitlines()[1].split()[10] == "350" and last.split()[10] == "4"  # the send lag, ms
    assert text.splitlines()[1].split()[11] == "-" and last.split()[11] == "42.5"  # critical_plus' p90 wait


def test_feasible_shares_follow_strict_class_order():
    # At 10 C: critical_plus asks 0.5 C and gets it all; critical asks 1.5 C and gets the
    # 0.5 C left, a third; the sheddable classes get nothing.
    f = feasible_shares(DEFAULT_MIX, 10.0)
    assert f["critical_plus"] == pytest.approx(1.0)
    assert f["critical"] == pytest.approx(1 / 3)
    assert f["sheddable_plus"] == 0.0 and f["sheddable"] == 0.0
    # At 1 C everything fits; at 2 C sheddable gets what is left (0.2 C of its 1 C).
    assert all(v == pytest.approx(1.0) for v in feasible_shares(DEFAULT_MIX, 1.0).values())
    assert feasible_shares(DEFAULT_MIX, 2.0)["sheddable"] == 0.0  # exactly: the classes above fill C
    assert share_of_feasible(0.006, feasible_shares(DEFAULT_MIX, 2.0)["sheddable"]) is None
    assert feasible_shares(DEFAULT_MIX, 1.25)["sheddable"] == pytest.approx((1 - 0.5 * 1.25) / (0.5 * 1.25))
    # The share of the feasible: what it got over what it could have had.
    assert share_of_feasible(0.152, 1 / 3) == pytest.approx(0.456)
    assert share_of_feasible(0.3, 0.0) is None
    with pytest.raises(ValueError, match="multiple"):
        feasible_shares(DEFAULT_MIX, 0)


def _phase(rate, answered, refused, cpu_s, duration_s=10.0, late=0):
    p = Phase(rate=rate, duration_s=duration_s, slo_s=1.0)
    p.outcomes = (
        [Outcome("critical", 200, "OK", 0.1)] * answered
        + [Outcome("critical", 200, "OK", 2.0)] * late
        + [Outcome("sheddable", 503, "OVERLOADED", 0.001)] * refused
        + [Outcome("sheddable", 0, "timeout", 10.0)]
    )
    p.server_cpu_s = cpu_s
    return p


def test_refusal_cpu_is_what_the_phase_used_beyond_its_answers():
    # 1 C: 100 answers cost 0.5 s (5 ms each). 10 C: 100 answers + 900 refusals in 0.68 s:
    # 0.18 s for the refusals, 0.2 ms each.
    phases = [_phase(10, 100, 0, 0.5), _phase(100, 100, 900, 0.68), _phase(20, 100, 5, 0.6)]
    costs = refusal_cpu_ms(phases)
    assert costs[0] is None and costs[2] is None  # nothing, or too little, refused to divide by
    assert costs[1] == pytest.approx(0.2)
    # What the processes use idle (0.02 cores over the 10 s phases) is neither the
    # answers' nor the refusals': 0.3 s for 100 answers, then 0.18 s for 900 refusals.
    for p, cpu_s in zip(phases, (0.5, 0.68, 0.6)):
        p.idle_cores, p.server_cpu_s = 0.02, cpu_s
    assert refusal_cpu_ms(phases)[1] == pytest.approx(0.2)
    phases[0].server_cpu_s = None
    assert refusal_cpu_ms(phases) == [None, None, None]


class GracefulStack:
    """A stack that refuses what it cannot serve (no cliff): over a long probe it answers
    ``sustained`` req/s, so it keeps sustained / rate of a higher rate; a short probe
    starts it empty and reads ``short_bonus`` x higher. Records each probe and settle."""

    def __init__(self, sustained: float, short_s: float, short_bonus: float) -> None:
        self.sustained, self.short_s, self.short_bonus = sustained, short_s, short_bonus
        self.calls: list[tuple[str, float]] = []
        self.long_rates: list[float] = []  # the rates offered over more than a short probe

    async def probe(self, rate: float, seconds: float, index: int) -> float:
        self.calls.append(("probe", seconds))
        if seconds > self.short_s:
            self.long_rates.append(rate)
        served = self.sustained * (self.short_bonus if seconds <= self.short_s else 1.0)
        return min(1.0, served / rate)

    async def settle(self) -> None:
        self.calls.append(("settle", 0.0))

    async def drain(self, seconds: float) -> None:  # no sleeping in unit tests
        self.calls.append(("drain", seconds))


def test_capacity_is_the_last_rung_that_also_passes_over_a_phase():
    stack = GracefulStack(sustained=55.0, short_s=8.0, short_bonus=60.0 / 55.0)
    cap, probes = asyncio.run(measure_capacity(stack.probe, 51.0, 8.0, 20.0, stack.settle, stack.drain))
    ladder = [p for p in probes if p[1] == 8.0]
    # The short ladder from 25.5 passes 63.1 (60 / 63.1 = 0.95) and stops at 70.7 (0.85, twice) ...
    assert ladder[-3][0] == pytest.approx(25.5 * 1.12**8) and ladder[-3][2] >= 0.9
    assert ladder[-2][0] == ladder[-1][0] == pytest.approx(25.5 * 1.12**9)
    assert ladder[-2][2] < 0.9 and ladder[-1][2] < 0.9
    # ... but over 20 s 63.1 keeps 55 / 63.1 = 0.87: one rung down, 56.4, keeps 0.976.
    assert [(round(r, 1), t, round(f, 3)) for r, t, f in probes[len(ladder) :]] == [
        (63.1, 20.0, 0.871),
        (56.4, 20.0, 0.976),
    ]
    assert cap == pytest.approx(25.5 * 1.12**7)
    # Each confirmation starts from a settled stack; the ladder's probes are only drained.
    assert stack.calls[0] == ("settle", 0.0)
    assert stack.calls[-4:] == [("settle", 0.0), ("probe", 20.0), ("settle", 0.0), ("probe", 20.0)]


class NoisyStack(GracefulStack):
    """A GracefulStack whose host was slow for the probes numbered in ``slow`` (each of
    them keeps ``slow_fraction``): one slow minute, not the stack's limit."""

    def __init__(self, sustained: float, slow: set[int], slow_fraction: float = 0.88) -> None:
        super().__init__(sustained, short_s=8.0, short_bonus=1.0)
        self.slow, self.slow_fraction = slow, slow_fraction

    async def probe(self, rate: float, seconds: float, index: int) -> float:
        frac = await super().probe(rate, seconds, index)
        return min(frac, self.slow_fraction) if index in self.slow else frac


def test_a_rung_missed_once_is_probed_again_before_the_ladder_stops():
    # Probe 3 (35.8 req/s, which the stack holds) lands on a slow minute: probed again, it
    # passes, and the ladder goes on to the stack's own limit.
    noisy = NoisyStack(sustained=55.0, slow={3})
    cap, probes = asyncio.run(measure_capacity(noisy.probe, 51.0, 8.0, 20.0, noisy.settle, noisy.drain))
    assert [round(r, 1) for r, _, _ in probes[3:5]] == [35.8, 35.8]
    assert probes[3][2] < 0.9 <= probes[4][2]
    assert cap == pytest.approx(25.5 * 1.12**7)  # 56.4 (55 req/s keeps 0.976 of it; 63.1 only 0.87)
    # Every stack gets the one second try, and no more: missed twice in a row, the ladder stops.
    twice = NoisyStack(sustained=55.0, slow={3, 4})
    cap, probes = asyncio.run(measure_capacity(twice.probe, 51.0, 8.0, 20.0, twice.settle, twice.drain))
    assert [round(r, 1) for r, t, _ in probes if t == 8.0] == [25.5, 28.6, 32.0, 35.8, 35.8]
    assert cap == pytest.approx(25.5 * 1.12**2)


def test_capacity_that_no_long_probe_confirms_is_an_error():
    stack = GracefulStack(sustained=10.0, short_s=8.0, short_bonus=6.0)  # short probes read 6x what it serves
    with pytest.raises(RuntimeError, match="no rung kept 90 % over 20 s"):
        asyncio.run(measure_capacity(stack.probe, 51.0, 8.0, 20.0, stack.settle, stack.drain))
    # Every rung the ladder passed (25.5 to 63.1 req/s) was tried over 20 s, from the top
    # down to the ladder's first, and no lower.
    assert [round(r, 1) for r in stack.long_rates] == [round(25.5 * 1.12**i, 1) for i in range(8, -1, -1)]
    with pytest.raises(RuntimeError, match="even 25.5 req/s misses the SLO"):
        asyncio.run(measure_capacity(GracefulStack(10.0, 8.0, 1.0).probe, 51.0, 8.0, 20.0, stack.settle, stack.drain))


def test_capacity_not_found_carries_the_lowest_rung_for_the_stacks_phases():
    from loadtest.bench_overload import CapacityNotFound

    stack = GracefulStack(sustained=10.0, short_s=8.0, short_bonus=6.0)
    with pytest.raises(CapacityNotFound) as e:
        asyncio.run(measure_capacity(stack.probe, 51.0, 8.0, 20.0, stack.settle, stack.drain))
    assert e.value.lowest == pytest.approx(25.5) and e.value.probes[0][0] == e.value.lowest


def test_a_stack_whose_c_is_not_found_runs_on_at_the_lowest_rung(monkeypatch, capsys):
    import types

    import loadtest.bench_overload as bo

    async def not_found(*_a, **_k):
        raise bo.CapacityNotFound("ballast-vllm: no rung kept 90 % over 20 s: [...]", [(7.6, 8.0, 0.8)])

    monkeypatch.setattr(bo, "find_capacity", not_found)
    bench = bo._Bench.__new__(bo._Bench)  # the wiring alone: no Ray, no speed probe
    args = types.SimpleNamespace(slo_s=1.0, probe_s=8.0, phase_s=20.0, seed=1)
    bench.args, bench.mix, bench.speed, bench.machine_at_c, bench.unmeasured = args, {}, None, {}, {}
    stack = types.SimpleNamespace(name="ballast-vllm", sdk=None)
    bench.stacks = {"ballast-vllm": stack}
    assert asyncio.run(bench.capacity(stack, None)) == 7.6
    assert bench.unmeasured["ballast-vllm"].startswith("C not found (ballast-vllm: no rung kept 90 %")
    assert "lowest rung, 7.6 req/s" in capsys.readouterr().out


def test_the_report_prints_every_stack_then_the_unmeasured_and_exits_1_after(capsys, tmp_path):
    """A stack whose C was not found (or whose session failed) keeps the run: the others' rows
    and targets print, then what was not measured and why; the exit status is 1 only then."""
    from loadtest.bench_overload import parse_settings, report

    s = parse_settings(["--multiples", "1,10", *a_model_dir(tmp_path)])
    results = {"llm": _run(12.0, (12.0, 0.4), multiples=(1.0, 10.0))}
    results["ballast-vllm"] = _run(7.6, (6.8, 6.0), multiples=(1.0, 10.0))
    why = {"ballast-vllm": "C not found (no rung kept 90 % over 20 s); multiples of the lowest rung, 7.6 req/s"}
    assert report(results, s, why) == 1
    out = capsys.readouterr().out
    assert "\nllm " in out and "\nballast-vllm " in out and "ballast-vllm: targets" in out
    assert out.index("not as measured") > out.index("ballast-vllm: targets")
    assert "  ballast-vllm: C not found (no rung kept 90 % over 20 s)" in out
    assert report(results, s, {}) == 0 and "not as measured" not in capsys.readouterr().out


def test_the_bounded_queue_is_what_the_replica_serves_within_the_slo():
    # 40 req/s for a 1 s SLO: a request queued behind more than 40 cannot make it.
    assert bounded_queue(40.0, 1.0, 1.0) == 40
    assert bounded_queue(40.0, 1.0, 0.25) == 10
    assert bounded_queue(1.0, 1.0, 0.25) == 1  # at least one


def test_the_targets_are_judged_per_multiple_and_against_the_peer():
    mix = {"critical_plus": 0.05, "critical": 0.15, "sheddable_plus": 0.30, "sheddable": 0.50}
    cap = 10.0

    def run(good_per_s):
        phases = []
        for k, g in zip((1.0, 10.0), good_per_s):
            p = Phase(rate=k * cap, duration_s=10.0, slo_s=1.0)
            p.outcomes = [Outcome("critical_plus", 200, "OK", 0.1)] * int(g * 10)
            p.server_cpu_s = 0.0
            phases.append(p)
        return {"C": cap, "phases": phases}

    ours, peer = run((9.6, 9.6)), run((9.8, 0.6))
    results = dict((what, ok) for what, ok, _ in check_targets(ours, (1.0, 10.0), mix, peer))
    assert results["goodput >= 0.95 C at every multiple"]
    assert results["nothing refused and level 0 at 1 C"]
    assert results["every answer within its deadline + 100 ms at p99"]
    ours["phases"][1].outcomes += [Outcome("critical", 504, "DEADLINE_EXCEEDED", 1.2)] * 10  # 200 ms late
    results = dict((what, ok) for what, ok, _ in check_targets(ours, (1.0, 10.0), mix, peer))
    assert not results["every answer within its deadline + 100 ms at p99"]
    ahead = "ahead of plain Serve with a bounded queue at every multiple (answers within the SLO per second)"
    assert not results[ahead]  # 9.6 < 9.8 req/s at 1 C
    # Judged in req/s, not against each one's C: a peer whose C probe stopped at half of
    # ours reads 1.2 C at 10 C on its ratio, and is still behind in what it answered.
    short = {"C": 5.0, "phases": run((4.9, 6.0))["phases"]}
    results = dict((what, ok) for what, ok, _ in check_targets(run((9.5, 9.2)), (1.0, 10.0), mix, short))
    assert results[ahead]
    ours = run((9.4, 9.6))
    results = dict((what, ok) for what, ok, _ in check_targets(ours, (1.0, 10.0), mix))
    assert not results["goodput >= 0.95 C at every multiple"]
    assert ahead not in results
    # One refusal at 1 C, or a sample at level 1 there, misses "nothing refused at 1 C".
    ours["phases"][0].outcomes.append(Outcome("sheddable", 503, "OVERLOADED", 0.01))
    assert not dict((w, ok) for w, ok, _ in check_targets(ours, (1.0, 10.0), mix))["nothing refused and level 0 at 1 C"]
    ours = run((9.5, 9.6))
    ours["phases"][0].trace = [{"level": 0}, {"level": 1}]
    assert not dict((w, ok) for w, ok, _ in check_targets(ours, (1.0, 10.0), mix))["nothing refused and level 0 at 1 C"]


def test_the_machine_column_reads_each_phase_against_the_speed_at_c():
    def phase(good: int, machine_rps):
        p = Phase(rate=100.0, duration_s=10.0, slo_s=1.0, machine_rps=machine_rps)
        p.outcomes = [Outcome("sheddable", 200, "OK", 0.1)] * good
        return p

    slow, same, untimed = phase(450, 45.0), phase(500, 50.0), phase(500, None)
    result = {"C": 50.0, "phases": [slow, same, untimed], "machine_at_c": 50.0}
    assert [machine_ratio(result, p) for p in result["phases"]] == ["0.90", "1.00", "-"]
    # 45 good a second at 0.9 of C's machine speed reads as 1.0 of C at that speed.
    assert machine_adjusted(result) == [pytest.approx(1.0), pytest.approx(1.0), None]
    given = {"C": 50.0, "phases": [slow], "machine_at_c": None}  # C given: no speed at C
    assert machine_ratio(given, slow) == "45/s" and machine_adjusted(given) == [None]


def test_the_speed_probe_times_the_replicas_own_batch_in_a_process_of_its_own():
    probe = SpeedProbeProcess({"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq_len": 128})
    try:
        assert 0 < probe.rows_per_second() < 1e6
        assert machine_speed._PROBE is None  # built and run in the probe's process, not here
    finally:
        probe.close()


# -- the vLLM stacks: llm, llm-bounded, ballast-vllm -----------------------------------------------
def test_a_completion_counts_only_with_its_choices_text():
    from loadtest.bench_overload import _judge, answer_text
    from loadtest.lean_http import LeanResponse

    done = b'{"id": "c", "choices": [{"index": 0, "text": " jumps", "finish_reason": "length"}]}'
    assert _judge(LeanResponse(200, {}, done), completions=True) == (200, "OK")
    for body in (b'{"choices": []}', b'{"choices": [{"text": null}]}', b'{"text": "abc"}', b"[]", b"not json"):
        assert _judge(LeanResponse(200, {}, body), completions=True) == (0, "malformed_200"), body
    # /v1/generate and plain Serve: the top-level text, as before; a completion's is not theirs.
    assert _judge(LeanResponse(200, {}, done)) == (0, "malformed_200")
    assert answer_text({"text": ""}) == "" and answer_text({"choices": [{"text": "x"}]}, completions=True) == "x"
    # ray.serve.llm's error bodies: a numeric code, or none at all.
    refused = LeanResponse(503, {}, b'{"error": {"message": "busy", "code": 503}}')
    assert _judge(refused, completions=True) == (503, "503")
    assert _judge(LeanResponse(503, {}, b"Service Unavailable"), completions=True) == (503, "HTTP_503")


def test_the_vllm_stacks_send_greedy_completions_to_their_openai_routes():
    from loadtest.bench_overload import BENCH_KEY, _stacks, parse_settings

    s = parse_settings(["--only", "ballast", "--max-tokens", "16"])
    stacks = _stacks(bench_config("cluster/local.yaml"), s.args, "demo")
    for name in ("llm", "llm-bounded", "ballast-vllm"):
        st = stacks[name]
        assert st.completions and st.path.endswith("/v1/completions")
        assert st.body("critical") == {
            "model": "demo",
            "prompt": st.body("sheddable")["prompt"],
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "criticality": "critical",
        }
        assert st.headers["X-Request-Timeout-Ms"] == "1000"
    assert stacks["llm"].path == "/llm/v1/completions" and stacks["llm-bounded"].path == "/llm-bounded/v1/completions"
    assert (
        stacks["ballast-vllm"].class_header and stacks["ballast-vllm"].headers["Authorization"] == f"Bearer {BENCH_KEY}"
    )
    assert not stacks["llm"].class_header and "Authorization" not in stacks["llm"].headers
    assert not stacks["ballast"].completions and not stacks["plain"].completions


def a_model_dir(tmp_path) -> list[str]:
    """``--vllm-model`` naming a directory the check accepts (a config.json): a clean
    clone has no models/demo until ``make demo-model``."""
    (tmp_path / "config.json").write_text("{}")
    return ["--vllm-model", str(tmp_path)]


def test_the_vllm_stacks_run_after_the_others_unless_left_out(tmp_path):
    from loadtest.bench_overload import parse_settings, sessions

    model = a_model_dir(tmp_path)
    s = parse_settings(model)
    assert s.names == ["plain", "plain-bounded", "ballast", "llm", "llm-bounded", "ballast-vllm"] and s.vllm
    assert sessions(s.names) == [
        ("plain", ["plain", "plain-bounded"]),
        ("ballast", ["ballast"]),
        ("llm", ["llm", "llm-bounded"]),
        ("ballast-vllm", ["ballast-vllm"]),
    ]
    s = parse_settings(["--no-vllm", "--sdk"])
    assert s.names == ["plain", "plain-bounded", "ballast", "ballast+sdk"] and not s.vllm
    assert sessions(s.names) == [("plain", ["plain", "plain-bounded"]), ("ballast", ["ballast", "ballast+sdk"])]
    for name, session in (("llm-bounded", "llm"), ("ballast-vllm", "ballast-vllm"), ("plain", "plain")):
        s = parse_settings(["--only", name, *model])
        assert s.names == [name] and sessions(s.names) == [(session, [name])]
        assert s.vllm == (name != "plain")
    # Several, in the run's order whatever order they are named in: the vLLM rows alone.
    s = parse_settings(["--only", "ballast-vllm,llm,llm-bounded", *model])
    assert s.names == ["llm", "llm-bounded", "ballast-vllm"]
    assert sessions(s.names) == [("llm", ["llm", "llm-bounded"]), ("ballast-vllm", ["ballast-vllm"])]


def test_the_vllm_flags_are_checked_before_anything_starts(tmp_path, capsys):
    from loadtest.bench_overload import parse_settings

    with pytest.raises(SystemExit):
        parse_settings(["--only", "llm", "--vllm-model", str(tmp_path)])  # no config.json there
    assert "make demo-model" in capsys.readouterr().err
    parse_settings(["--only", "ballast", "--vllm-model", str(tmp_path)])  # no vLLM stack: not needed
    with pytest.raises(SystemExit):
        parse_settings(["--llm-queue-factor", "0"])
    with pytest.raises(SystemExit):
        parse_settings(["--only", "vllm"])
    with pytest.raises(SystemExit):
        parse_settings(["--only", "llm,nope"])
    assert "'nope' is no stack" in capsys.readouterr().err
    (tmp_path / "m").mkdir()
    model = a_model_dir(tmp_path / "m")
    assert parse_settings(["--only", "llm-bounded", "--llm-queue-factor", "0.5", *model]).args.llm_queue_factor == 0.5


def test_llm_bounded_queues_a_fixed_share_of_what_the_engine_serves_in_one_slo():
    # --llm-queue-factor 0.25 (the default) of C x SLO: 30 req/s for a 1 s SLO queues 8.
    assert bounded_queue(30.0, 1.0, 0.25) == 8
    assert bounded_queue(5.0, 1.0, 0.25) == 1


def test_both_vllm_stacks_get_ballasts_engine_settings(tmp_path, monkeypatch):
    from loadtest.bench_overload import VLLM_ENGINE_KWARGS, VLLM_RSS_LIMIT_MB, bench_vllm_config, vllm_engine_kwargs

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    model_dir = _vllm_model_dir(tmp_path)
    cfg = bench_vllm_config("cluster/local.yaml", model_dir)
    m = cfg.model
    assert (m.backend, m.name) == ("vllm", "demo-vllm") and m.path.endswith("demo-vllm")
    assert m.engine_kwargs == vllm_engine_kwargs(m.path, m.max_batch_size)
    assert VLLM_ENGINE_KWARGS.items() <= m.engine_kwargs.items() and m.engine_kwargs["max_num_seqs"] == m.max_batch_size
    # A KV cache for every row's whole context: 32 rows x 512 tokens x K and V x 4 layers
    # x 2 KV heads x 64 dims x 4 bytes, as Ballast's replica sizes its own.
    assert m.engine_kwargs["kv_cache_memory_bytes"] == 32 * 512 * 2 * 4 * 2 * 64 * 4
    assert cfg.watchdog.rss_limit_mb == VLLM_RSS_LIMIT_MB
    assert (cfg.deployments.model.min_replicas, cfg.deployments.model.max_replicas) == (1, 1)
    assert cfg.auth.demo_keys and cfg.http.port == bench_config("cluster/local.yaml").http.port


def _vllm_model_dir(tmp_path):
    """A config.json of the demo model's kind: what the engine settings are computed from."""
    import json

    d = tmp_path / "demo-vllm"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "num_attention_heads": 4,
                "hidden_size": 256,
                "num_key_value_heads": 2,
                "num_hidden_layers": 4,
                "max_position_embeddings": 1024,
            }
        )
    )
    return str(d)


def _run(cap, good_per_s, cp_good=None, multiples=(1.0, 2.0, 4.0, 10.0)):
    """A fabricated run: per multiple, ``good_per_s`` answers a second within the SLO over 10 s,
    all critical_plus, and one critical_plus miss where ``cp_good`` says it kept less."""
    phases = []
    for k, g in zip(multiples, good_per_s):
        p = Phase(rate=k * cap, duration_s=10.0, slo_s=1.0)
        p.outcomes = [Outcome("critical_plus", 200, "OK", 0.1)] * int(g * 10)
        if cp_good is not None and cp_good.get(k):
            p.outcomes.append(Outcome("critical_plus", 503, "OVERLOADED", 0.01))
        phases.append(p)
    return {"C": cap, "phases": phases}


def test_ballast_on_vllm_is_judged_on_goodput_critical_plus_and_against_plain_llm():
    from loadtest.bench_overload import check_vllm_targets

    ours, llm = _run(20.0, (19.5, 19.0, 19.2, 19.1)), _run(12.0, (12.0, 3.0, 1.0, 0.4))
    ours["at_llm_c"] = _phase_at(12.0, 0.25, 0.4)
    llm["phases"][0].outcomes = [Outcome("critical", 200, "OK", 0.25)] * 118 + [
        Outcome("critical", 200, "OK", 0.38)
    ] * 2
    checks = check_vllm_targets(ours, MULTIPLES, DEFAULT_MIX, llm)
    results = {what: ok for what, ok, _ in checks}
    ahead = "ahead of plain ray.serve.llm at every multiple (answers within the SLO per second)"
    latency = "p50 and p99 within 1.1x of plain ray.serve.llm's at its 1 C"
    assert list(results) == [
        "goodput >= 0.95 C at every multiple",
        "critical_plus >= 0.999 where its demand fits in C",
        "nothing refused and level 0 at 1 C",
        "C >= 0.95 x plain ray.serve.llm's",
        latency,
        ahead,
    ]
    assert all(results.values())
    detail = dict((what, d) for what, _, d in checks)
    assert detail[ahead].startswith("1C:19.5/12.0 req/s (goodput/C 0.975/1.000)")
    assert detail[latency] == "at 12.0 req/s: p50 250 / 250 ms = 1.00, p99 400 / 380 ms = 1.05"
    # 10 C: critical_plus asks 0.5 C, which fits; one miss in 182 is below 99.9 %.
    results = {
        w: ok
        for w, ok, _ in check_vllm_targets(_run(20.0, (19.5, 19.0, 19.2, 19.1), {10.0: 1}), MULTIPLES, DEFAULT_MIX, llm)
    }
    assert not results["critical_plus >= 0.999 where its demand fits in C"]
    # 4 C at 0.93 of C misses goodput; behind plain llm at 1 C misses "ahead"; a C below
    # 0.95 of llm's, a p99 past 1.1x of llm's, or no phase at llm's C miss theirs.
    results = {
        w: ok for w, ok, _ in check_vllm_targets(_run(20.0, (19.5, 19.0, 18.6, 19.1)), MULTIPLES, DEFAULT_MIX, llm)
    }
    assert not results["goodput >= 0.95 C at every multiple"] and results[ahead] and not results[latency]
    behind = {w: ok for w, ok, _ in check_vllm_targets(ours, MULTIPLES, DEFAULT_MIX, _run(12.0, (19.6, 3.0, 1.0, 0.4)))}
    assert not behind[ahead]
    small = {**ours, "C": 11.3}
    assert not {w: ok for w, ok, _ in check_vllm_targets(small, MULTIPLES, DEFAULT_MIX, llm)}[
        "C >= 0.95 x plain ray.serve.llm's"
    ]
    ours["at_llm_c"] = _phase_at(12.0, 0.25, 0.45)
    assert not {w: ok for w, ok, _ in check_vllm_targets(ours, MULTIPLES, DEFAULT_MIX, llm)}[latency]
    # Without llm's run there is nothing to compare with.
    assert {w for w, _, _ in check_vllm_targets(ours, MULTIPLES, DEFAULT_MIX)} == set(list(results)[:3])


def _phase_at(rate: float, p50_s: float, p99_s: float) -> Phase:
    """A phase at ``rate`` whose 200s have this p50 and p99 (100 answers)."""
    p = Phase(rate=rate, duration_s=10.0, slo_s=1.0)
    p.outcomes = [Outcome("critical", 200, "OK", p50_s)] * 99 + [Outcome("critical", 200, "OK", p99_s)]
    return p


def test_the_report_prints_the_vllm_stacks_and_their_targets(capsys, tmp_path):
    from loadtest.bench_overload import REPORT, parse_settings

    s = parse_settings(["--multiples", "1,10", *a_model_dir(tmp_path)])
    results = {
        "llm": _run(12.0, (12.0, 0.4), multiples=(1.0, 10.0)),
        "llm-bounded": {
            **_run(11.0, (11.0, 10.5), multiples=(1.0, 10.0)),
            "queue": {"max_ongoing_requests": 32, "max_queued_requests": 3, "factor": 0.25},
        },
        "ballast-vllm": _run(20.0, (19.5, 18.1), multiples=(1.0, 10.0)),
    }
    for section in REPORT:
        section(results, s)
    out = capsys.readouterr().out
    for name in results:
        assert f"\n{name} " in out
    assert (
        "llm-bounded: the ingress's max_ongoing_requests 32" in out
        and "max_queued_requests 3 (0.25 x C x SLO, fixed)" in out
    )
    assert "ballast-vllm: targets" in out and "[ok] ahead of plain ray.serve.llm" in out
    assert (
        "] ahead of ray.serve.llm, bounded at every multiple (answers within the SLO per second): 1C:19.5/11.0" in out
    )


def test_each_process_of_a_stack_is_named_by_its_role_on_the_path():
    from loadtest.stack_cpu import role_of

    assert role_of("haproxy", "/usr/sbin/haproxy") == "edge"
    assert role_of("python", "ray::ServeReplica:ballast:BallastRouter") == "router"
    assert role_of("python", "ray::ServeReplica:default:OpenAiIngress") == "router"
    assert role_of("python", "ray::ServeReplica:ballast:BallastModel") == "front"
    assert role_of("python", "ray::ServeReplica:ballast:BallastModel-tiny") == "front"
    assert role_of("python", "ray::ServeReplica:default:LLMServer:demo") == "front"
    assert role_of("python", "ray::ServeReplica:ballast:BallastFallbackModel") == "fallback"
    assert role_of("VLLM::EngineCor", "VLLM::EngineCore") == "engine"
    assert role_of("VLLM::Worker", "VLLM::Worker_TP0") == "engine"
    assert role_of("python", "ray::Watchdog.beat") == "guards"
    assert role_of("python", "ray::Controller") == "guards"
    assert role_of("python", "ray::ServeController") == "serve"
    assert role_of("python", "ray::ProxyActor") == "proxy"
    assert role_of("raylet", "/x/ray/core/src/ray/raylet/raylet") == "ray"
    assert role_of("python", "python -m loadtest.bench_overload") is None  # the load generator is not the stack
    assert role_of("python", "ray::ServeReplica:other:Thing") is None


def test_the_cost_section_prints_each_roles_cpu_per_answer(capsys, tmp_path):
    from loadtest.bench_overload import _print_cost, parse_settings

    s = parse_settings(["--multiples", "1", *a_model_dir(tmp_path)])
    p = Phase(rate=10.0, duration_s=10.0, slo_s=1.0)
    p.outcomes = [Outcome("critical", 200, "OK", 0.1)] * 99 + [Outcome("critical", 200, "OK", 0.5)]
    p.stack_cpu = {"router": 0.5, "engine": 8.0, "engine wait": 3.0}
    _print_cost({"ballast-vllm": {"C": 10.0, "phases": [p]}}, s)
    row, cores, waits = capsys.readouterr().out.splitlines()[3:6]
    cells = row.split()
    assert cells[:4] == ["ballast-vllm", "1C", "100", "500"]  # p50 and p99 of the 200s, ms
    assert cells[4 + 2] == "5.00" and cells[4 + 4] == "80.00"  # router 0.5 s / 100 answers; the engine's
    assert cores.split()[1 + 2] == "0.05" and cores.split()[1 + 4] == "0.80"
    assert waits.split()[0] == "waiting" and waits.split()[1 + 4] == "0.30"  # 3 s of the engine's wait in 10 s
    assert waits.split()[1 + 2] == "0.00"


def test_the_cost_section_says_when_a_vllm_stacks_engine_was_not_counted(capsys, tmp_path):
    from loadtest.bench_overload import _print_cost, parse_settings

    s = parse_settings(["--multiples", "1", *a_model_dir(tmp_path)])
    phases = {}
    for name, engine in (("ballast-vllm", 0.0), ("llm", 8.0), ("ballast", 0.0)):
        p = Phase(rate=10.0, duration_s=10.0, slo_s=1.0)
        p.outcomes = [Outcome("critical", 200, "OK", 0.1)] * 10
        p.stack_cpu = {"router": 0.5, "front": 2.0, "engine": engine}
        phases[name] = {"C": 10.0, "phases": [p]}
    _print_cost(phases, s)
    lines = capsys.readouterr().out.splitlines()
    flagged = [i for i, line in enumerate(lines) if "were not found: its engine cells are not measured" in line]
    assert len(flagged) == 1  # the built-in engine runs in front; llm's engine was counted
    assert lines[flagged[0] - 3].split()[0] == "ballast-vllm"


def test_a_stacks_waits_for_a_core_are_read_from_its_threads_schedstat():
    import threading

    from loadtest.stack_cpu import StackCpu, delta, thread_waits, wait_key

    waits = thread_waits(os.getpid())
    assert threading.get_native_id() in waits and all(w >= 0.0 for w in waits.values())
    assert thread_waits(2**22 + 7) == {}  # no such process: nothing, not an error
    cpu = StackCpu()
    first = cpu.read()
    assert set(first) >= {"engine", wait_key("engine"), wait_key("router")}
    assert all(v >= 0.0 for v in delta(cpu.read(), first).values())
