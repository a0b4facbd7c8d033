"""Fair shares between two backlogged tenants: through one router, and through two routers
with skewed ingress (``make bench-fairness``, parts 2 and 3).

Tenant ``a`` sends prompts 4x longer than tenant ``b``'s; both ask for the same number of
tokens, in the same class, from closed-loop workers, more of them than the model takes at
once, so that both always wait at a gate. What each tenant was served is counted from its
answers in the measured window, as the fair-share counters weigh it (1 x prompt + 2 x
generated tokens, ``fairness.input_weight`` / ``output_weight``), and as raw tokens.
The check: each tenant's service over its weight, a's over b's, within 10 % of 1, and
Jain's index over them >= 0.95.

- **One router** (part 2): both tenants through ``/``; weights 1:1, then 2:1; beside
  each, the same with the fair-share counters off (first come, first served).
- **Two routers, skewed ingress** (part 3): a second router application (``/r2``) in
  front of the same model replica and controller; ``a`` only through ``/`` with 4x the
  workers of ``b``, only through ``/r2``. With the counters shared, the controller
  apportions the model among the routers by who waits where; beside it, the same run
  with sharing off (each router orders its own line and takes half the model).

Loopback only; bounded in time (each setting ``--warmup-s`` + ``--measure-s``).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ballast.policies.fairness import FairnessConfig, jain_index
from loadtest.lean_http import LeanClient, LeanHttpError

KEYS = {"a": "dev-key-fair-a", "b": "dev-key-fair-b"}
SHORT_PROMPT = "b" * 24
LONG_PROMPT = "a" * 96  # 4x the tokens of b's on the built-in byte model
MAX_TOKENS = 16
BASELINES = ("first come, first served", "not shared")
MODEL_SLOTS = 8  # the model replica's max_ongoing_requests: well under either tenant's workers


def shares_config(base: dict[str, Any], weights: tuple[float, float], enabled: bool, shared: bool) -> dict[str, Any]:
    """``base`` (cluster/local.yaml's data) with the two tenants, one model replica of
    MODEL_SLOTS slots, no fallback and the fair-share settings of this run."""
    data = {**base}
    data["tenants"] = {t: {"weight": w, "max_concurrent": 256} for t, w in zip("ab", weights)}
    data["auth"] = {**base.get("auth", {}), "demo_keys": {key: t for t, key in KEYS.items()}}
    data["fallback"] = None
    deployments = {**base.get("deployments", {})}
    deployments["model"] = {
        **deployments.get("model", {}),
        "min_replicas": 1,
        "max_replicas": 1,
        "max_ongoing_requests": MODEL_SLOTS,
    }
    data["deployments"] = deployments
    data["fairness"] = {**base.get("fairness", {}), "enabled": enabled, "shared": shared}
    return data


@dataclass
class Served:
    answers: int = 0
    prompt_tokens: int = 0
    generated: int = 0
    codes: Counter = field(default_factory=Counter)


async def closed_loop(
    c: LeanClient, path: str, key: str, prompt: str, prompt_tokens: int, workers: int, warmup_s: float, measure_s: float
) -> Served:
    """``workers`` clients sending one request after another; what was answered inside the
    measured window (after ``warmup_s``) is counted."""
    served = Served()
    start = time.monotonic()
    measure_from, stop = start + warmup_s, start + warmup_s + measure_s
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "criticality": "critical"}
    headers = {"Authorization": f"Bearer {key}"}

    async def worker() -> None:
        while time.monotonic() < stop:
            try:
                r = await c.post_json(path, body, headers)
            except LeanHttpError as e:
                served.codes[e.kind] += 1
                continue
            now = time.monotonic()
            if not measure_from <= now <= stop:
                continue
            if r.status != 200:
                served.codes[r.status] += 1
                continue
            served.codes[200] += 1
            served.answers += 1
            served.prompt_tokens += prompt_tokens
            served.generated += int(r.json().get("tokens_generated", 0))

    await asyncio.gather(*(worker() for _ in range(workers)))
    return served


@dataclass(frozen=True)
class ShareRow:
    part: str
    setting: str
    weights: tuple[float, float]
    a: Served
    b: Served
    fair: FairnessConfig  # how the counters weigh the tokens

    def per_weight(self) -> tuple[float, float]:
        """Each tenant's service as its counter weighs it."""
        wa, wb = self.weights
        return (
            self.fair.cost(self.a.prompt_tokens, self.a.generated, wa),
            self.fair.cost(self.b.prompt_tokens, self.b.generated, wb),
        )

    def ratio(self) -> float:
        pa, pb = self.per_weight()
        return pa / pb if pb else float("inf")

    def jain(self) -> float:
        return jain_index(self.per_weight())

    @property
    def baseline(self) -> bool:
        """A setting shown for comparison (fair shares off, or not shared)."""
        return self.setting in BASELINES

    def meets(self) -> bool:
        return abs(self.ratio() - 1.0) <= 0.10 and self.jain() >= 0.95


def render(rows: list[ShareRow]) -> list[str]:
    out = [
        f"{'part':<22} {'setting':<24} {'w a:b':>6} {'a answers':>9} {'b answers':>9} "
        f"{'a tokens':>9} {'b tokens':>9} {'(a/wa)/(b/wb)':>13} {'Jain':>6}  target"
    ]
    for r in rows:
        wa, wb = r.weights
        out.append(
            f"{r.part:<22} {r.setting:<24} {wa:g}:{wb:<4g} {r.a.answers:>9} {r.b.answers:>9} "
            f"{r.a.prompt_tokens + r.a.generated:>9} {r.b.prompt_tokens + r.b.generated:>9} "
            f"{r.ratio():>13.3f} {r.jain():>6.3f}  "
            f"{'(what it improves on)' if r.baseline else 'ok' if r.meets() else 'MISSED'}"
        )
    out.append(
        "tokens: prompt + generated, raw; the ratio and Jain's index weigh them as the counters do "
        "(1 x prompt + 2 x generated) over each tenant's weight; target: ratio within 10 % of 1, Jain >= 0.95"
    )
    return out


SECOND_APP = "ballast-r2"
SECOND_PREFIX = "/r2"


def _deploy(cfg: Any, second_router: bool) -> None:
    """This setting's config to the controller and the application (its replicas restart
    where their config changed); with ``second_router``, a router application of its own at
    SECOND_PREFIX in front of the same model deployment."""
    from ray import serve

    from ballast.names import MODEL_DEPLOYMENT
    from ballast.ops.app import deploy
    from ballast.router.app import router_deployment

    deploy(cfg)
    if second_router:
        model = serve.get_deployment_handle(MODEL_DEPLOYMENT, app_name=cfg.app_name)
        app = router_deployment(cfg).bind(model, cfg.model_dump(mode="json"), None)
        serve.run(app, name=SECOND_APP, route_prefix=SECOND_PREFIX, blocking=False)


def _without_second_router() -> None:
    from ray import serve

    if SECOND_APP in serve.status().applications:
        serve.delete(SECOND_APP)


def run(base: dict[str, Any], port: int, warmup_s: float, measure_s: float, log: Any = print) -> list[ShareRow]:
    """Parts 2 and 3, every setting in turn on one local stack; their rows."""
    from ballast.config import load_config
    from ballast.router.tokens import model_text
    from loadtest.bench_router import local_stack

    first = load_config(shares_config(base, (1.0, 1.0), True, True))
    text = model_text(first.model)
    tokens = {"a": text.count(LONG_PROMPT), "b": text.count(SHORT_PROMPT)}
    settings = []
    for weights in ((1.0, 1.0), (2.0, 1.0)):
        settings += [
            ("one router", "fair shares", weights, True, True, False),
            ("one router", "first come, first served", weights, False, True, False),
            ("two routers, skewed", "counters shared", weights, True, True, True),
            ("two routers, skewed", "not shared", weights, True, False, True),
        ]
    rows: list[ShareRow] = []
    with local_stack(first):
        for part, setting, weights, enabled, shared, two in settings:
            cfg = load_config(shares_config(base, weights, enabled, shared))
            log(f"{part}, {setting}, weights {weights[0]:g}:{weights[1]:g}")
            if not two:
                _without_second_router()
            _deploy(cfg, two)
            f = cfg.fairness

            async def measure(two: bool) -> tuple[Served, Served]:
                async with LeanClient("127.0.0.1", port, max_connections=200, timeout_s=60.0) as c:
                    # One router: 24 workers each. Two: a 4x b's offered load, each through its own router.
                    a_workers, b_workers, b_path = (
                        (48, 12, f"{SECOND_PREFIX}/v1/generate") if two else (24, 24, "/v1/generate")
                    )
                    return await asyncio.gather(
                        closed_loop(
                            c, "/v1/generate", KEYS["a"], LONG_PROMPT, tokens["a"], a_workers, warmup_s, measure_s
                        ),
                        closed_loop(c, b_path, KEYS["b"], SHORT_PROMPT, tokens["b"], b_workers, warmup_s, measure_s),
                    )

            a, b = asyncio.run(measure(two))
            rows.append(ShareRow(part, setting, weights, a, b, f.policy_config()))
            log("  " + render(rows[-1:])[1])
        _without_second_router()
    return rows
