"""A model larger than one device: one replica spanning two tensor-parallel ranks.

For this module the session's stack is replaced by one whose primary model is a tiny
random Llama served by vLLM's CPU build with ``tensor_parallel_size: 2`` (and put back
after): its one replica is a Ray placement group of two bundles of one logical CPU, the
replica in the first; vLLM runs a worker process per rank under the replica, each rank's
OpenMP threads on a core of its own. Through the real HTTP endpoint: the placement group
and the ranks' processes are there and watched by name; greedy answers equal the same
weights' at one rank (transformers, in this process); killing one rank's process under
load has the replica killed as a whole, the watchdog's reason naming the rank, and every
request in flight answered by the replacement; a tensor-parallel size no node can hold is
refused at deploy with what it needs and what the node has.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

pytest.importorskip("vllm")

import conftest as integration  # noqa: E402
from conftest import ADMIN, BASE, GOLD, _deploy, _merge, model_status, status, wait_until  # noqa: E402
from test_recycling import events, ids  # noqa: E402
from test_vllm import engine_processes, vllm_overrides  # noqa: E402

from ballast.model.demo import VLLM_GEOMETRY, make_llama  # noqa: E402

pytestmark = pytest.mark.integration
# Deploys a stack of its own and leaves it running (conftest.py: the default comes back once).
OWN_STACK = True

MODEL = "tiny-tp"
KEY = GOLD["Authorization"].split()[1]
PROMPTS = ["The quick brown fox", "A replica serves requests; the router sends", "Tokens per second"]


def tp_config(ckpt, tp: int = 2) -> dict:
    """The session's config serving ``ckpt`` with ``tp`` tensor-parallel ranks in one replica."""
    over = vllm_overrides(ckpt)
    model = {k: v for k, v in over["model"].items() if k != "tool_parser"}  # the router loads no parser
    model["name"] = MODEL
    model["engine_kwargs"] = {**model["engine_kwargs"], "tensor_parallel_size": tp}
    # A request that lost its replica waits for the replacement (a vLLM engine of two ranks
    # starts in 20-60 s here) within its deadline.
    resilience = {"deadline_s": 150, "max_deadline_s": 180, "breaker": {"half_open_max_wait_s": 180}}
    # A batch line's claim must outlast its deadline (config check); this stack runs no batch.
    batch = {"claim_idle_s": 151}
    return _merge(integration.test_config_dict(), {**over, "model": model, "resilience": resilience, "batch": batch})


@pytest.fixture(scope="module")
def tp_stack(ballast, tmp_path_factory):
    from ballast.config import load_config

    ckpt = make_llama(tmp_path_factory.mktemp("tp") / MODEL, **VLLM_GEOMETRY)
    # From the default stack, not from another module's: replicas of an earlier vLLM stack
    # still shutting down (two engines each) were read as this stack's ranks when the TP
    # stack replaced one directly (the first clean clone run after modules kept their stacks).
    if integration._Deployed.now is not ballast:
        _deploy(ballast, ballast.model.name)
    started = time.monotonic()
    _deploy(load_config(tp_config(ckpt)), MODEL)
    print(f"\nthe TP=2 stack served {time.monotonic() - started:.0f} s after deploy")
    yield ckpt


@pytest.fixture
def http(tp_stack):
    with httpx.Client(base_url=BASE, timeout=120) as c:
        yield c


def replica_row(http) -> dict:
    rows = http.get("/admin/replicas", headers=ADMIN).json()["replicas"]
    return next(r for r in rows if r["deployment"] == "BallastModel")


def ranks(http) -> dict[str, int]:
    """The TP replica's vLLM rank processes, by the names vLLM gives them (``VLLM::Worker_TP0``,
    ``VLLM::Worker_TP1``): live processes of those names under a process Ray titled as a
    BallastModel replica. Only a stack of several ranks names its workers so (a replica of an
    earlier one-rank vLLM stack still shutting down has a ``VLLM::Worker``), so a scan of the
    live tree finds this stack's ranks whatever else is shutting down; whether the replica
    handed them to its watchdog is asserted apart, from the watchdog's report."""
    import psutil

    out = {}
    for p in psutil.process_iter(["cmdline"]):
        if not (p.info["cmdline"] or [""])[0].startswith("ray::ServeReplica:ballast:BallastModel"):
            continue
        try:
            for child in p.children(recursive=True):
                name = child.name()
                if name in TP_WORKERS:
                    out[name] = child.pid
        except psutil.Error:
            continue
    return out


TP_WORKERS = ("VLLM::Worker_TP0", "VLLM::Worker_TP1")


def test_one_replica_is_a_placement_group_of_two_ranks_each_watched(http):
    from ray.util import placement_group_table

    groups = [g for g in placement_group_table().values() if g["state"] == "CREATED" and "BallastModel" in g["name"]]
    assert [(g["strategy"], list(g["bundles"].values())) for g in groups] == [
        ("STRICT_PACK", [{"CPU": 1.0}, {"CPU": 1.0}])
    ], groups
    found = ranks(http)
    assert set(found) == set(TP_WORKERS), engine_processes()
    watchdog = wait_until(lambda: replica_row(http)["watchdog"], 20, 0.25, "the watchdog's first report")
    watched = {name for _, name in watchdog["engine_processes"]}
    assert {"VLLM::EngineCore", *TP_WORKERS} <= watched, (watchdog["engine_processes"], found)
    assert {pid for pid, name in watchdog["engine_processes"] if name in TP_WORKERS} == set(found.values())
    deployments = status(http)["deployments"]  # Serve's own word, as `ballast status` shows it
    assert deployments["BallastModel"]["status"] == "HEALTHY", deployments


def test_greedy_answers_equal_the_same_weights_at_one_rank(tp_stack, http):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tp_stack, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tp_stack, dtype="float32").eval()
    sdk = openai.OpenAI(base_url=f"{BASE}/v1", api_key=KEY, max_retries=0, timeout=60)
    for prompt in PROMPTS:
        got = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        ids = tok(prompt).input_ids
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id)
        new = out[0, len(ids) :].tolist()
        assert got.usage.completion_tokens == len(new)
        assert got.choices[0].text == tok.decode(new, skip_special_tokens=True), prompt


def _generate(prompt: str, stream: bool, out: dict) -> None:
    body = {"prompt": prompt, "max_tokens": 160, "stream": stream}
    headers = {**GOLD, "X-Request-Timeout-Ms": "170000"}
    with httpx.Client(base_url=BASE, timeout=190) as c:
        if not stream:
            r = c.post("/v1/generate", headers=headers, json=body)
            answer = r.json()
            model = answer.get("model") if answer.get("fallback") is None else answer.get("fallback")
            out[prompt] = (r.status_code, answer.get("text"), int(r.headers.get("x-ballast-migrations", 0)), model)
            return
        with c.stream("POST", "/v1/generate", headers=headers, json=body) as r:
            events, name = [], None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[len("event: ") :]
                elif line.startswith("data: "):
                    events.append((name, json.loads(line[len("data: ") :])))
        text = "".join(d["text"] for n, d in events if n == "token")
        done = events[-1][1] if events and events[-1][0] == "done" else {}
        model = done.get("model") if done.get("fallback") is None else done.get("fallback")
        out[prompt] = (r.status_code if done else 599, text, int(done.get("migrations", 0)), model)


def test_a_rank_killed_under_load_recycles_the_replica_and_fails_no_request(http):
    (rid,) = ids(http, "BallastModel")
    body = {"max_tokens": 160}
    reference = {p: http.post("/v1/generate", headers=GOLD, json={**body, "prompt": p}).json()["text"] for p in PROMPTS}
    lost_before = model_status(http)["lost_capacity"]
    victim = ranks(http)["VLLM::Worker_TP1"]
    answers: dict = {}
    senders = [
        threading.Thread(target=_generate, args=(p, i == 0, answers), daemon=True) for i, p in enumerate(PROMPTS)
    ]
    for t in senders:
        t.start()
    wait_until(  # all three: one still on its way is not "sent again" (a clean clone saw it)
        lambda: (replica_row(http).get("running") or 0) >= len(PROMPTS), 20, 0.1, "requests in the replica's engine"
    )
    os.kill(victim, signal.SIGKILL)
    t_kill = time.monotonic()
    (killed,) = wait_until(
        lambda: [e for e in events(http, "killed_hung") if e["replica_id"] == rid], 30, 0.3, "the replica killed"
    )
    t_killed = time.monotonic() - t_kill
    for t in senders:
        t.join(180)
    assert f"VLLM::Worker_TP1 (pid {victim}) exited" in killed["reason"], killed
    assert {p: a[0] for p, a in answers.items()} == {p: 200 for p in PROMPTS}, answers
    assert {p: a[1] for p, a in answers.items()} == reference  # greedy: the replacement answers the same
    assert all(a[2] >= 1 and a[3] == MODEL for a in answers.values()), answers  # sent again, not to the fallback
    lost = model_status(http)["lost_capacity"]
    assert lost["migrated"] >= lost_before["migrated"] + len(PROMPTS)
    assert lost["not_migrated"] == lost_before["not_migrated"]
    new = wait_until(lambda: ids(http, "BallastModel") - {rid}, 120, 1.0, "a replacement replica")
    print(
        f"\nrank killed: replica killed {t_killed:.1f} s later ({killed['reason']}); every request answered "
        f"{time.monotonic() - t_kill:.0f} s after the kill, by {sorted(new)}"
    )


def test_a_tensor_parallel_size_no_node_holds_is_refused_at_deploy(tp_stack, http):
    from ballast.config import load_config
    from ballast.errors import ConfigError
    from ballast.ops.app import deploy

    with pytest.raises(ConfigError) as e:
        deploy(load_config(tp_config(tp_stack, tp=8)))
    assert str(e.value) == (
        f"placement: model {MODEL}: tensor_parallel_size 8 x pipeline_parallel_size 1 needs {{CPU: 8}} on one "
        "node (STRICT_PACK: 8 bundles of {CPU: 1}); the largest node has {CPU: 4}"
    )
    r = http.post("/v1/generate", headers=GOLD, json={"prompt": "still here", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["model"] == MODEL  # nothing was deployed
