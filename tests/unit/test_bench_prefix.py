"""The prefix benchmark's pure parts: the workload, the stream reader, the counters and figures."""

import math
import re

import pytest

from loadtest.bench_prefix import (
    ROWS,
    Conversation,
    Figures,
    Outcome,
    RowResult,
    StreamAnswer,
    WorkloadSpec,
    ballast_counters,
    ballast_data,
    chat_body,
    conversations,
    counter_deltas,
    counter_series,
    default_kv_blocks,
    hit_ceiling,
    hit_ratio,
    level_summary,
    max_over_mean,
    parse_args,
    prometheus_counters,
    read_settled,
    route_counts,
    summary_line,
    target_checks,
    tenant_key,
    tenant_name,
    working_set_blocks,
)

SUMMARY = re.compile(
    r"^(?P<row>[a-z0-9-]+): hit=(?P<hit>\d\.\d{3}|nan) ttft_p50_ms=(\d+|nan) ttft_p99_ms=(\d+|nan) "
    r"slo_rps=(\d+\.\d{2}|nan) max_over_mean=(\d+\.\d{3}|nan)$"
)


# -- the workload ----------------------------------------------------------------------------------
def test_the_workload_is_the_same_for_a_seed_and_another_for_another_seed():
    def sent(seed):
        out = []
        for conv in conversations(WorkloadSpec(seed=seed)):
            for turn in range(6):  # past the end of a conversation: the next one is seeded too
                out.append(conv.messages())
                conv.answered(f"answer {turn}")
        return out

    assert sent(7) == sent(7)
    assert sent(7) != sent(8)
    assert len(conversations(WorkloadSpec(users_per_tenant=3))) == 16 * 3


def test_each_tenant_has_its_own_system_prompt_from_its_first_words():
    spec = WorkloadSpec()
    prompts = [spec.system_prompt(t) for t in range(spec.tenants)]
    assert len({" ".join(p.split()[:2]) for p in prompts}) == spec.tenants
    assert all(len(p.split()) == spec.system_words + 3 for p in prompts)  # "Tenant N rules." + the words
    # The users of a tenant share its system prompt and nothing after it.
    a, b = Conversation(spec, 5, 0), Conversation(spec, 5, 1)
    assert a.messages()[0] == b.messages()[0] and a.messages()[1] != b.messages()[1]


def test_a_common_preamble_is_the_same_start_of_every_tenants_system_prompt():
    spec = WorkloadSpec(common_words=20)
    prompts = [spec.system_prompt(t) for t in range(spec.tenants)]
    assert len({" ".join(p.split()[:20]) for p in prompts}) == 1  # the preamble, shared
    assert len({" ".join(p.split()[:22]) for p in prompts}) == spec.tenants  # then each its own
    assert WorkloadSpec().system_prompt(3).startswith("Tenant 3 rules.")  # none by default
    with pytest.raises(ValueError):
        WorkloadSpec(common_words=-1)


def test_a_conversation_grows_by_repeating_its_earlier_turns_then_starts_anew():
    spec = WorkloadSpec(turns=3)
    conv = Conversation(spec, 2, 1)
    first = conv.messages()
    assert [m["role"] for m in first] == ["system", "user"]
    previous = first
    for turn in range(1, 3):
        conv.answered(f"answer {turn}")
        now = conv.messages()
        # The earlier prompt, then the model's answer to it, then one new user message.
        assert now[: len(previous)] == previous
        assert now[len(previous)] == {"role": "assistant", "content": f"answer {turn}"}
        assert now[len(previous) + 1]["role"] == "user" and len(now) == len(previous) + 2
        previous = now
    conv.answered("answer 3")  # the last turn: a new conversation with the same system prompt
    again = conv.messages()
    assert conv.index == 1 and len(again) == 2
    assert again[0] == first[0] and again[1] != first[1]


def test_the_working_set_counts_shared_system_blocks_once_and_each_users_conversation():
    spec = WorkloadSpec(tenants=2, users_per_tenant=3, turns=2)

    def count(messages):  # 64 tokens a message
        return 64 * len(messages)

    # System alone: 64 tokens, 2 blocks of 32, shared. Turn 1: 2 messages, 128 tokens, 4 blocks,
    # 2 of them the user's. Turn 2: 4 messages and one 32-token answer, 288 tokens, 9 blocks, 7
    # the user's. Per tenant: 2 + 3 users x (2 + 7) / 2 = 15.5.
    assert working_set_blocks(spec, count, 32, 32) == pytest.approx(31.0)
    assert working_set_blocks(spec, count, 0, 32) == pytest.approx(2 * (2 + 3 * (2 + 6) / 2))


def test_the_hit_ceiling_finds_each_turns_earlier_full_blocks():
    spec = WorkloadSpec(tenants=2, users_per_tenant=3, turns=2)

    def count(messages):
        return 64 * len(messages)

    # Turn 1: 128 tokens, the system prompt's 64 found. Turn 2: 256 + 32, turn 1's 128 found.
    assert hit_ceiling(spec, count, 32, 32) == pytest.approx((64 + 128) / (128 + 288))
    # Only full blocks are found: 64 tokens are one block of 48 and a part.
    assert hit_ceiling(spec, count, 32, 48) == pytest.approx((48 + 96) / (128 + 288))


def test_one_replicas_cache_is_a_share_of_the_working_set_and_holds_a_full_context():
    assert default_kv_blocks(320.0, 1024, 32, share=0.5) == 160
    assert default_kv_blocks(320.5, 1024, 32, share=0.5) == 161
    assert default_kv_blocks(400.0, 1024, 32) == 240  # KV_SHARE 0.6
    assert default_kv_blocks(31.0, 1024, 32) == 33  # 32 blocks for a 1024-token prompt, and one more


def test_the_request_is_streamed_greedy_and_of_a_fixed_length():
    body = chat_body("demo", [{"role": "user", "content": "hi"}], 24)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["ignore_eos"] is True and body["max_tokens"] == 24


# -- one streamed answer ---------------------------------------------------------------------------
def _event(obj) -> bytes:
    import json

    return b"data: " + json.dumps(obj).encode() + b"\r\n\r\n"


def test_ttft_is_the_first_chunk_with_content_whatever_the_pieces():
    role = _event({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    first = _event({"choices": [{"delta": {"content": "Hel"}}]})
    second = _event({"choices": [{"delta": {"content": "lo"}}]})
    usage = _event({"choices": [], "usage": {"prompt_tokens": 350, "completion_tokens": 24}})
    stream = role + first + second + usage + b"data: [DONE]\r\n\r\n"
    a = StreamAnswer()
    a.feed(role, 10.0)  # the role alone: no content yet
    assert a.first_content_s is None
    cut = len(first) // 2
    a.feed(first[:cut], 10.5)  # half an event: nothing yet
    assert a.first_content_s is None
    a.feed(first[cut:-1], 10.6)  # all but the last "\n": the event is not over
    assert a.first_content_s is None
    a.feed(stream[len(role) + len(first) - 1 :], 10.7)
    assert a.first_content_s == 10.7 and a.text == "Hello" and a.prompt_tokens == 350 and a.done
    out = a.outcome(10.2, 200, stream)
    assert out.ok and out.ttft_ms == pytest.approx(500.0) and out.prompt_tokens == 350


def test_a_200_counts_only_complete_and_errors_keep_their_code():
    content = _event({"choices": [{"delta": {"content": "x"}}]})
    cut_short = StreamAnswer()
    cut_short.feed(content, 1.0)  # no [DONE]
    assert cut_short.outcome(0.0, 200, content).code == "incomplete"
    silent = StreamAnswer()
    silent.feed(b"data: [DONE]\n\n", 1.0)  # done, but no text
    assert silent.outcome(0.0, 200, b"").code == "incomplete"
    failed = StreamAnswer()
    failed.feed(content + _event({"error": {"code": "ENGINE_FAILED", "message": "x"}}) + b"data: [DONE]\n\n", 1.0)
    assert failed.outcome(0.0, 200, b"").code == "ENGINE_FAILED"
    refused = StreamAnswer().outcome(0.0, 429, b'{"error": {"code": "RATE_LIMITED"}}')
    assert (refused.status, refused.code, refused.ok) == (429, "RATE_LIMITED", False)
    assert StreamAnswer().outcome(0.0, 502, b"<html>").code == "HTTP_502"


# -- counters and figures --------------------------------------------------------------------------
def test_hit_rate_and_the_busiest_replica_come_from_counter_differences():
    before = {"r1": (1000, 400), "r2": (500, 100)}
    after = {"r1": (4000, 3100), "r2": (2500, 1900), "r3": (200, 0)}  # r3 started in the span
    deltas = counter_deltas(before, after)
    assert deltas == {"r1": (3000, 2700), "r2": (2000, 1800), "r3": (200, 0)}
    assert hit_ratio(deltas) == pytest.approx(4500 / 5200)
    assert max_over_mean(deltas) == pytest.approx(3000 / (5200 / 3))
    assert max_over_mean({"a": (100, 0), "b": (100, 0)}) == 1.0
    assert max_over_mean({"a": (100, 0), "b": (0, 0)}) == 2.0  # all the work on one of two
    assert math.isnan(hit_ratio({})) and math.isnan(max_over_mean({"a": (0, 0)}))


def test_the_figures_of_a_span():
    def ok(ttft_ms):
        return Outcome(0.0, 200, "OK", ttft_ms, 300)

    outcomes = [ok(float(ms)) for ms in range(100, 1100, 10)]  # 100 answers, 100..1090 ms
    outcomes += [Outcome(0.0, 429, "RATE_LIMITED"), Outcome(0.0, 200, "incomplete", 50.0)]
    r = RowResult("x", duration_s=10.0, outcomes=outcomes, deltas={"a": (300, 240), "b": (100, 60)})
    f = r.figures(ttft_slo_ms=1000.0)
    assert f.ttft_p50_ms == 600.0 and f.ttft_p99_ms == 1090.0
    assert f.slo_rps == pytest.approx(91 / 10.0)  # 100..1000 ms; the incomplete one does not count
    assert f.hit_ratio == pytest.approx(0.75) and f.max_over_mean == pytest.approx(1.5)
    missing = RowResult("x", duration_s=10.0, outcomes=outcomes).figures(1000.0)  # counters not read
    assert math.isnan(missing.hit_ratio) and math.isnan(missing.max_over_mean) and missing.slo_rps > 0
    failed = RowResult("x", error="did not start: boom")
    assert all(math.isnan(v) for v in vars(failed.figures(1000.0)).values())
    assert failed.max_level is None and RowResult("x", levels={0: 40, 2: 3, 1: 7}).max_level == 2


def test_ballasts_levels_and_reasons_are_counted_from_its_status_samples():
    from loadtest.bench_overload import one_model

    def sample(level: int, reason: "str | None") -> dict:
        """A one-model /v1/status as the benchmark samples it (``one_model``)."""
        state = {"level": level, "reason": reason} if reason is not None else {}
        return one_model({"models": {"m": {"level": level}}, "snapshot": {"models": {"m": state}}})

    trace = [
        sample(0, "hold 0: queue_wait_ms=120<250"),
        sample(1, "up 0->1: queue_wait_ms=300>=250"),
        sample(2, "up 1->2: queue_wait_ms=650>=500"),
        sample(2, "up 1->2: queue_wait_ms=700>=500"),
        sample(2, None),
        {"_t": 3.0},  # a failed read leaves no level
    ]
    levels, reasons = level_summary(trace)
    assert levels == {0: 1, 1: 1, 2: 3}
    assert reasons["up 1->2: queue_wait_ms"] == (2, "up 1->2: queue_wait_ms=700>=500")
    assert sum(k for k, _ in reasons.values()) == 4


def test_the_summary_line_has_one_form_for_scripts():
    line = summary_line("ballast-affinity", Figures(0.8126, 153.4, 2047.6, 7.456, 1.0504))
    assert line == ("ballast-affinity: hit=0.813 ttft_p50_ms=153 ttft_p99_ms=2048 slo_rps=7.46 max_over_mean=1.050")
    assert SUMMARY.match(line)
    nan = float("nan")
    assert SUMMARY.match(summary_line("serve-llm-prefix", Figures(nan, nan, nan, nan, nan)))


def test_ballast_counters_are_the_model_deployments_rows():
    doc = {
        "replicas": [
            {"replica_id": "m1", "deployment": "BallastModel", "prefix_cache_queries": 900, "prefix_cache_hits": 450},
            {"replica_id": "m2", "deployment": "BallastModel", "prefix_cache_queries": 100, "prefix_cache_hits": 0},
            {"replica_id": "f1", "deployment": "BallastFallbackModel", "prefix_cache_queries": None},
            {"replica_id": "m3", "deployment": "BallastModel", "prefix_cache_queries": None},  # not reported yet
        ]
    }
    assert ballast_counters(doc, "BallastModel") == {"m1": (900, 450), "m2": (100, 0)}
    assert ballast_counters({}, "BallastModel") == {}


def test_ray_metrics_are_read_per_replica_with_or_without_total():
    text = "\n".join(
        [
            "# HELP ray_vllm_prefix_cache_queries Prefix cache queries.",
            "# TYPE ray_vllm_prefix_cache_queries counter",
            'ray_vllm_prefix_cache_queries_total{ReplicaId="a",WorkerId="w1",engine="0"} 1200.0',
            'ray_vllm_prefix_cache_queries_total{ReplicaId="b",WorkerId="w2",engine="0"} 800.0',
            'ray_vllm_prefix_cache_queries_total{ReplicaId="b",WorkerId="w2",engine="1"} 100.0',
            "# HELP ray_vllm_prefix_cache_hits Prefix cache hits.",
            "# TYPE ray_vllm_prefix_cache_hits counter",
            'ray_vllm_prefix_cache_hits_total{ReplicaId="a",WorkerId="w1",engine="0"} 600.0',
            "# TYPE ray_other gauge",
            'ray_other{ReplicaId="a"} 5.0',
        ]
    )
    assert prometheus_counters(text) == {"a": (1200, 600), "b": (900, 0)}
    assert counter_series(text) == [
        "ray_vllm_prefix_cache_hits_total{ReplicaId,WorkerId,engine}",
        "ray_vllm_prefix_cache_queries_total{ReplicaId,WorkerId,engine}",
    ]
    assert prometheus_counters("# nothing here\n") == {}


def test_ballasts_route_decisions_are_counted_by_reason_for_its_model():
    text = "\n".join(
        [
            "# TYPE ray_ballast_route_decisions counter",
            'ray_ballast_route_decisions_total{model="demo",reason="prefix",WorkerId="r1"} 30.0',
            'ray_ballast_route_decisions_total{model="demo",reason="prefix",WorkerId="r2"} 12.0',
            'ray_ballast_route_decisions_total{model="demo",reason="balance",WorkerId="r1"} 5.0',
            'ray_ballast_route_decisions_total{model="other",reason="home",WorkerId="r1"} 9.0',
        ]
    )
    assert route_counts(text, "demo") == {"prefix": 42, "balance": 5}
    assert route_counts(text, "absent") == {}
    assert counter_series(text, ("ray_ballast_route_decisions",)) == [
        "ray_ballast_route_decisions_total{WorkerId,model,reason}"
    ]


def test_counters_are_read_once_they_have_not_moved_for_the_quiet_time():
    now = [0.0]
    reads = iter([{"a": (1, 0)}, {"a": (5, 2)}, None, {"a": (9, 4)}, {"a": (9, 4)}, {"a": (9, 4)}, {"a": (9, 4)}])
    seen = []

    async def read():
        seen.append(now[0])
        return next(reads)

    async def sleep(s):
        now[0] += s

    import asyncio

    got = asyncio.run(read_settled(read, quiet_s=1.5, poll_s=0.5, clock=lambda: now[0], sleep=sleep))
    # Moved at 0.5, failed at 1.0, moved at 1.5; still at 2.0, 2.5 and 3.0: 1.5 s quiet.
    assert got == {"a": (9, 4)} and seen == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]

    def moving():
        n = iter(range(1000))

        async def read():
            return {"a": (next(n), 0)}

        return read

    now[0] = 0.0
    got = asyncio.run(read_settled(moving(), quiet_s=1.0, max_s=3.0, poll_s=0.5, clock=lambda: now[0], sleep=sleep))
    assert got == {"a": (6, 0)} and now[0] == 3.0  # bounded: the last read at max_s


def test_the_targets_are_informational_and_say_what_was_not_measured():
    nan = float("nan")
    figs = {
        "ballast-p2c": Figures(0.40, 500.0, 3000.0, 5.0, 1.10),
        "ballast-affinity": Figures(0.85, 250.0, 1500.0, 8.0, 1.20),
        "ballast-one-group": Figures(0.88, 230.0, 1400.0, 8.0, 1.20),
        "serve-llm-prefix": Figures(0.70, 300.0, 2500.0, 6.0, 1.40),
    }
    assert [met for _, met, _ in target_checks(figs)] == [True, True, True, True, True, True]
    figs["ballast-affinity"] = Figures(0.55, 400.0, 2600.0, 6.0, 1.40)
    assert [met for _, met, _ in target_checks(figs)] == [False, False, False, False, False, False]
    figs["serve-llm-prefix"] = Figures(nan, 300.0, 2500.0, 6.0, nan)  # its counters not read
    assert target_checks(figs)[3][1] is None and target_checks(figs)[3][2].startswith("not measured")
    only = target_checks({"ballast-affinity": figs["ballast-affinity"]})
    assert [met for _, met, _ in only] == [False, None, None, None, None, False]
    assert only[1][2] == "row not run"


# -- the stacks' settings and the command line -----------------------------------------------------
def test_ballast_rows_have_a_key_per_tenant_two_routers_two_replicas_and_their_routing():
    from ballast.config import load_config

    kwargs = {"dtype": "float32", "num_gpu_blocks_override": 161, "block_size": 32}
    for affinity, one_group in ((False, False), (True, False), (True, True)):
        cfg = load_config(ballast_data("cluster/local.yaml", "models/demo", kwargs, affinity, 16, one_group))
        groups = {cfg.tenants[tenant_name(t)].cache_group for t in range(16)}
        assert groups == ({"bench-all"} if one_group else {None})  # one group, or each its own
        m = cfg.models[0]
        assert m.backend == "vllm" and m.engine_kwargs == kwargs and m.routing.prefix_affinity is affinity
        assert cfg.deployments.router.num_replicas == 2
        dep = cfg.deployments.model
        assert dep.min_replicas == dep.max_replicas == 2
        assert cfg.fallback_of(m.name) is None
        keys = cfg.auth.demo_keys
        assert all(keys[tenant_key(t)] == tenant_name(t) for t in range(16))
        assert len({tenant_key(t) for t in range(16)}) == 16


def test_rows_are_a_subset_in_their_order(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    model = ["--vllm-model", str(tmp_path)]
    assert parse_args(model).rows == ROWS
    assert parse_args(model + ["--rows", "serve-llm-prefix,ballast-p2c"]).rows == ("ballast-p2c", "serve-llm-prefix")
    for bad in ("ballast", "ballast-p2c,ballast-p2c", ""):
        with pytest.raises(SystemExit):
            parse_args(model + ["--rows", bad])
    with pytest.raises(SystemExit):
        parse_args(model + ["--duration-s", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--vllm-model", str(tmp_path / "absent")])
