"""Several models behind one endpoint, and LoRA adapters per tenant, through the real
HTTP endpoint and the official ``openai`` client.

For this module the session's stack is replaced by one serving two models (put back
after): ``tiny-vllm``, a tiny random Llama on vLLM's CPU build with two LoRA adapters
(``sql`` for every tenant, ``support`` for gold alone), and ``tiny-hf``, another tiny
Llama on the transformers engine whose token costs three in a tenant's bucket. The
request's ``model`` field chooses; ``GET /v1/models`` lists what the key may use.
"""

from __future__ import annotations

import copy

import httpx
import openai
import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")

import conftest as integration  # noqa: E402
from conftest import ADMIN, BASE, _deploy, wait_until  # noqa: E402
from test_vllm import vllm_overrides  # noqa: E402

from ballast.model.demo import VLLM_GEOMETRY, make_llama, make_lora_adapter, make_tiny_llama  # noqa: E402

pytestmark = pytest.mark.integration
# Deploys a stack of its own and leaves it running (conftest.py: the default comes back once).
OWN_STACK = True

VLLM, HF = "tiny-vllm", "tiny-hf"
PROMPT = "The quick brown fox"


def two_models_config(root) -> dict:
    """The session's config with a ``models`` list in place of ``model``."""
    base = make_llama(root / VLLM, **VLLM_GEOMETRY)
    adapters = {
        name: make_lora_adapter(base, root / name, seed) for seed, name in enumerate(("sql", "support", "late"))
    }
    over = vllm_overrides(base)
    vllm_model = {**over["model"], "name": VLLM}
    vllm_model["adapters"] = {
        "sql": str(adapters["sql"]),
        "support": {"path": str(adapters["support"]), "tenants": ["gold"]},
    }
    vllm_model["deployment"] = {"min_replicas": 1, "max_replicas": 1, "num_cpus": 0, "num_gpus": 0}
    hf = {
        "name": HF,
        "backend": "transformers",
        "path": str(make_tiny_llama(root / HF)),
        "cost_per_token": 3.0,
        "deployment": {"min_replicas": 1, "max_replicas": 1, "num_cpus": 0, "num_gpus": 0},
    }
    cfg = integration._merge(integration.test_config_dict(), {k: v for k, v in over.items() if k != "model"})
    cfg.pop("model")
    cfg["models"] = [vllm_model, hf]
    # A tenant whose bucket hardly refills: what a request costs it can be read off the bucket.
    cfg["tenants"]["metered"] = {"rate_tokens_per_s": 0.001, "burst_tokens": 100000, "max_concurrent": 4}
    cfg["adapters_root"] = str(root)  # POST /admin/adapters loads from under here only
    (root / "empty").mkdir()  # under the root, but no adapter in it
    (root / "link-out").symlink_to(root.parent)  # under the root by name, out of it once resolved
    cfg["auth"]["demo_keys"] = {**cfg["auth"]["demo_keys"], "dev-key-metered": "metered"}
    return cfg, adapters


@pytest.fixture(scope="module")
def stack(ballast, tmp_path_factory):
    from ballast.config import load_config

    data, adapters = two_models_config(tmp_path_factory.mktemp("models"))
    _deploy(load_config(copy.deepcopy(data)), HF)
    yield adapters


def sdk(key: str = "dev-key-gold") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key=key, max_retries=0, timeout=120)


def greedy(model: str, key: str = "dev-key-gold") -> str:
    out = sdk(key).completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.model == model  # the answer names what was asked, an adapter as the request named it
    return out.choices[0].text


def test_each_key_lists_the_models_and_adapters_it_may_use(stack):
    gold = [(m.id, m.model_extra.get("parent")) for m in sdk().models.list()]
    assert gold == [(VLLM, None), ("sql", VLLM), ("support", VLLM), (HF, None)]
    assert [m.id for m in sdk("dev-key-free").models.list()] == [VLLM, "sql", HF]


def test_the_model_field_chooses_between_two_models(stack):
    hf = sdk().chat.completions.create(model=HF, messages=[{"role": "user", "content": "hi"}], max_tokens=6)
    vllm = sdk().chat.completions.create(model=VLLM, messages=[{"role": "user", "content": "hi"}], max_tokens=6)
    assert (hf.model, vllm.model) == (HF, VLLM)
    assert hf.usage.completion_tokens > 0 and vllm.usage.completion_tokens > 0


def test_a_base_and_two_adapters_answer_their_own_and_each_repeats(stack):
    answers = {name: greedy(name) for name in (VLLM, "sql", f"{VLLM}:support")}
    assert len(set(answers.values())) == 3, answers  # three different outputs
    assert {name: greedy(name) for name in answers} == answers  # each the same again


def test_an_adapter_not_granted_is_404_while_another_tenant_uses_it(stack):
    with pytest.raises(openai.NotFoundError) as e:
        greedy("support", key="dev-key-free")
    assert e.value.code == "model_not_found" and "yours: tiny-vllm, sql, tiny-hf" in e.value.message
    assert greedy("support")  # gold's grant


def test_an_adapter_added_and_removed_at_run_time(stack):
    def post(name: str, path: str):
        return c.post(
            "/admin/adapters", headers=ADMIN, json={"model": VLLM, "name": name, "path": path, "tenants": "*"}
        )

    with httpx.Client(base_url=BASE, timeout=120) as c:
        for path, field, why in (
            ("/tmp", "path", "is not under adapters_root"),  # the router's check, by the text
            ("link-out", "path", "resolves outside adapters_root"),  # the replica's, on its node
            ("empty", "adapters", "No adapter found"),  # vLLM's own reason, at the admin call
        ):
            bad = post("broken", path)
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "ADAPTER_REFUSED", bad.text
            assert bad.json()["error"]["field"] == field and why in bad.json()["error"]["message"]
        added = post("late", str(stack["late"]))
        assert added.status_code == 201, added.text
        again = post("late", "empty")  # one name, one directory: deleted first
        assert again.status_code == 409 and again.json()["error"]["code"] == "ADAPTER_CONFLICT", again.text
        late = wait_until(lambda: _answer_or_none("late"), 30, 0.5, "the router's catalog to list 'late'")
        assert late != greedy(VLLM) and late == greedy("late")
        assert c.delete("/admin/adapters/late", headers=ADMIN).status_code == 200
        wait_until(lambda: _answer_or_none("late") is None, 30, 0.5, "'late' to be gone")
        assert c.delete("/admin/adapters/sql", headers=ADMIN).status_code == 409  # the config's: removed there


def _answer_or_none(model: str):
    try:
        return greedy(model)
    except openai.NotFoundError:
        return None


def test_a_kill_switch_on_one_adapter_leaves_its_base_and_the_other_serving(stack):
    with httpx.Client(base_url=BASE, timeout=60) as c:
        r = c.post(
            "/admin/kill-switch",
            headers=ADMIN,
            json={"scope": "model", "value": "sql", "reason": "bad answers", "expires_in_s": 120},
        )
        assert r.status_code == 201, r.text
        try:

            def switched_off() -> bool:
                try:
                    greedy("sql")
                except openai.APIStatusError as e:
                    return e.status_code == 503 and e.code == "KILL_SWITCH"
                return False

            wait_until(switched_off, 15, 0.5, "the kill switch on 'sql' to reach the router")
            assert greedy(VLLM) and greedy("support")
        finally:
            c.delete(f"/admin/kill-switch/{r.json()['id']}", headers=ADMIN)


def test_usage_is_each_models_tokens_and_the_quota_charges_each_models_cost(stack):
    def bucket() -> float:
        return httpx.get(f"{BASE}/v1/status", headers=ADMIN, timeout=10).json()["quotas"]["metered"]["tokens"]

    spent = {}
    for model, cost in ((VLLM, 1.0), (HF, 3.0)):
        before = bucket()
        out = sdk("dev-key-metered").completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        spent[model] = (before - bucket(), out.usage.total_tokens * cost)
    for model, (drop, expected) in spent.items():
        assert drop == pytest.approx(expected, abs=1.0), (model, spent)  # the bucket shows tenths
    with pytest.raises(openai.NotFoundError):
        sdk("dev-key-metered").completions.create(model="nope", prompt=PROMPT, max_tokens=2)
