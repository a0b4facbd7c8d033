"""``ballast status`` and ``ballast tenants``: the ``GET /v1/status`` document as an operator reads it.

Pure: a document in, text (or rows) out; ``ballast status --json`` prints the document.
The document holds every model alike, in maps keyed by model: ``models`` (each as the
answering router acts on it: level, source, constraints, breakers, retry budget, lost
capacity, gate, flex hold), ``snapshot.models`` (the controller's state of each: level,
target, reason, inputs, deployment, routing) and ``batch.models`` (each model's batch
queue and dead letters as this router last read them from the store, and its dispatch
here: lines running, held, the room for more; ``batch`` is null where the router has no
store). The summary gives one block per model, then what the router shares across models
(batches it finalized, replicas, deployments, quotas, recycles, kill switches, chaos).

Every section is optional, so a router that answers without a snapshot (a controller
never seen) or without a gate still gets a summary, and a newer router's extra keys are
simply not shown.
"""

from __future__ import annotations

from typing import Any

# A tenant whose bucket holds at most this share of its burst is "near its quota": the
# next few requests of a typical size would be refused with 429 QUOTA_EXCEEDED.
NEAR_QUOTA_RATIO = 0.2
#: The level's inputs the summary shows (the rest are in ``--json``).
SHOWN_INPUTS = ("queue_length", "queue_wait_p95_ms", "kv_util_pct", "gpu_util_pct", "vram_pct", "error_rate")


def _num(v: Any, fmt: str = "g") -> str:
    return "-" if v is None else format(v, fmt)


def _map(doc: dict[str, Any], *path: str) -> dict[str, Any]:
    """``doc[path[0]][path[1]]...``, or {} where a step is missing or null."""
    for key in path:
        got = doc.get(key) if isinstance(doc, dict) else None
        doc = got if isinstance(got, dict) else {}
    return doc


def model_names(doc: dict[str, Any]) -> list[str]:
    """Every model the document names: the router's in its order, then any only the
    controller's snapshot names."""
    names = list(_map(doc, "models"))
    return names + [n for n in _map(doc, "snapshot", "models") if n not in names]


def model_view(doc: dict[str, Any], name: str | None) -> dict[str, Any]:
    """Model ``name`` in a /v1/status document: the router's view of it (its entry in
    ``models``: level, source, gate, breakers, ...) and, under ``controller``, the
    controller's state of it (its entry in ``snapshot.models``: target, reason, inputs, ...).
    {} for a model the document does not name (or None)."""
    if name is None:
        return {}
    mine, state = _map(doc, "models", name), _map(doc, "snapshot", "models", name)
    if not mine and not state:
        return {}
    return {**mine, "controller": state}


def sole_model(doc: dict[str, Any]) -> str | None:
    """The one model a router serving one names in its /v1/status document; None when it
    names none or several."""
    names = model_names(doc)
    return names[0] if len(names) == 1 else None


def format_status(doc: dict[str, Any], near_quota_ratio: float = NEAR_QUOTA_RATIO) -> str:
    """The /v1/status document as text: the snapshot, one block per model, then the router's own."""
    out: list[str] = []
    _status_snapshot(doc, out)
    for name in model_names(doc):
        _status_model(doc, name, out)
    _status_batch(doc, out)
    _status_replicas(doc, out)
    _status_deployments(doc, out)
    _status_quotas(doc, out, near_quota_ratio)
    _status_actions(doc, out)
    chaos = _map(doc, "chaos")
    if chaos:
        out.append("chaos: " + "; ".join(f"{t} {s}" for t, s in sorted(chaos.items())))
    return "\n".join(out)


def _status_snapshot(doc: dict[str, Any], out: list[str]) -> None:
    snap = _map(doc, "snapshot")
    if snap:
        out.append(f"snapshot v{snap.get('version')} ({snap.get('epoch')}), age {_num(snap.get('age_s'), '.1f')} s")
    else:
        out.append("no snapshot from the controller yet")


def _status_model(doc: dict[str, Any], name: str, out: list[str]) -> None:
    """One model: the level the router acts on and why (the controller's state of it), its
    inputs and constraints, its replicas, routing, breakers, lost capacity and gate."""
    mine, state = _map(doc, "models", name), _map(doc, "snapshot", "models", name)
    level = mine.get("level", state.get("level"))
    head = f"model {name}: level {_num(level)}"
    if state.get("target_level") is not None and state.get("target_level") != level:
        head += f" (target {state['target_level']})"
    out.append(head + f": {state.get('reason') or 'no word from the controller'}")
    source = mine.get("source", "snapshot")
    if source != "snapshot":  # stale or fail-static: the router is acting on its own
        out.append(f"  acting on: {source} (no fresh word from the controller on this model)")
    inputs = _map(state, "inputs")
    if inputs:
        out.append("  inputs: " + ", ".join(f"{k} {_num(inputs.get(k))}" for k in SHOWN_INPUTS if k in inputs))
    cons = _map(mine, "constraints")
    if cons:
        out.append("  constraints: " + ", ".join(f"{k} {v}" for k, v in cons.items()))
    dep = state.get("deployment")
    if dep:
        r = _map(doc, "replicas", dep)
        out.append(f"  replicas running / desired: {_num(r.get('running'))} / {_num(r.get('desired'))} ({dep})")
    routing = _routing_line(_map(state, "routing"))
    if routing:
        out.append(f"  routing: {routing}")
    _model_health(mine, out)
    _model_gate(_map(mine, "gate"), out)
    _model_flex(_map(mine, "flex"), out)
    _model_batch(_map(doc, "batch", "models", name), out)


def _routing_line(routing: dict[str, Any]) -> str:
    """A model's routing summary (the controller's ``RoutingSummary``): what is known of it."""
    parts = []
    if routing.get("prefix_hit_ratio") is not None:
        parts.append(f"prefix-cache hits {routing['prefix_hit_ratio']:.0%}")
    if routing.get("routed_by_prefix_ratio") is not None:
        parts.append(f"routed by prefix {routing['routed_by_prefix_ratio']:.0%}")
    if routing.get("load_max_over_mean") is not None:
        parts.append(f"most loaded replica {routing['load_max_over_mean']:.2f}x the mean")
    return ", ".join(parts)


def _model_health(mine: dict[str, Any], out: list[str]) -> None:
    """A model's capacity lost with replicas, its hedges, and its breakers."""
    lost = _map(mine, "lost_capacity")
    if any(lost.values()):
        out.append(
            f"  lost capacity: {lost.get('migrated', 0)} carried on elsewhere, {lost.get('not_migrated', 0)} not "
            "(to the fallback, else 503 REPLICA_LOST): replicas or nodes that went away, not model errors"
        )
    hedges = _map(mine, "hedges")
    if hedges.get("sent"):
        out.append(
            f"  hedges: {hedges['sent']} sent ({hedges.get('won', 0)} answered first), "
            f"{hedges.get('denied', 0)} denied by the budget"
        )
    breakers = _map(mine, "breakers")
    if breakers:
        out.append("  breakers:")
        for role, b in breakers.items():
            line = f"    {role}: {b.get('state', '?')}"
            if b.get("calls"):
                line += f", {b.get('failures', 0)} failed and {b.get('slow_calls', 0)} slow of {b['calls']} calls"
            if b.get("state") == "open" and b.get("retry_after_s"):
                line += f", half-open in {b['retry_after_s']:.0f} s"
            out.append(line)


def _model_gate(gate: dict[str, Any], out: list[str]) -> None:
    """A model's gate, and whose counters order its wait line."""
    if not gate:
        return
    line = (
        f"  gate: limit {_num(gate.get('limit'))}, {gate.get('in_flight', 0)} at the model, "
        f"{gate.get('waiting', 0)} waiting"
    )
    if gate.get("reserving"):
        line += ", reserving slots for critical"
    refused = {k: v for k, v in _map(gate, "refused").items() if v}
    if refused:
        line += ", refused " + ", ".join(f"{k} {v}" for k, v in sorted(refused.items()))
    out.append(line)
    fair = _map(gate, "fairness")
    if fair:
        cluster = fair.get("view") == "cluster"
        whose = "cluster-wide counters" if cluster else "this router's own counters (no controller reply)"
        waiting = ", ".join(fair.get("backlogged") or []) or "none"
        out.append(f"  fair shares: {whose}; tenants waiting: {waiting}")


def _model_flex(flex: dict[str, Any], out: list[str]) -> None:
    """A model's flex hold at this router: requests held for spare capacity, the oldest's
    wait, and those refused (by reason) or answered 504 while held."""
    if not flex:
        return
    line = f"  flex: {flex.get('held', 0)} held (at most {_num(flex.get('max_held'))})"
    if flex.get("oldest_held_s") is not None:
        line += f", oldest {flex['oldest_held_s']:.1f} s"
    refused = {k: v for k, v in _map(flex, "refused").items() if v}
    if refused:
        line += ", refused " + ", ".join(f"{k} {v}" for k, v in sorted(refused.items()))
    if flex.get("expired"):
        line += f", {flex['expired']} ran out of time while held (504)"
    out.append(line)


def _model_batch(batch: dict[str, Any], out: list[str]) -> None:
    """A model's batch queue and dead letters (the store's, as this router last read them:
    the same at every router) and its batch lines at this router."""
    if not batch:
        return
    if "queued" in batch:
        out.append(
            f"  batch queue: {batch['queued']} lines queued or running, oldest {_num(batch.get('age_s'), '.0f')} s; "
            f"dead letters: {_num(batch.get('dlq'))}"
        )
    else:  # the finalizer has not read the store yet (or every read failed)
        out.append("  batch queue: not read from the store yet")
    line = (
        f"  batch here: {batch.get('running', 0)} running, {batch.get('held', 0)} held, "
        f"room for {_num(batch.get('room'))} more"
    )
    lines = {k: v for k, v in _map(batch, "lines").items() if v}
    if lines:
        line += "; lines since it started: " + ", ".join(f"{k} {v}" for k, v in sorted(lines.items()))
    out.append(line)
    if "rows_cap" in batch:  # a router older than the step bound says nothing of it
        ref = batch.get("reference_rows")
        out.append(
            f"  batch step bound: {_num(batch.get('rows_cap'))} rows with interactive ones; "
            + (f"interactive rows at their high {ref}" if ref is not None else "no interactive rows in the window")
        )


def _status_batch(doc: dict[str, Any], out: list[str]) -> None:
    """The router's batch dispatch: off (no store here), or the batches in progress and those it finalized."""
    if "batch" not in doc:  # a router older than the Batch API
        return
    batch = doc["batch"]
    if not isinstance(batch, dict):
        out.append("batch: off at this router (batch.enabled false or no batch.store_url): its routes answer 503")
        return
    in_progress = batch.get("in_progress")
    if in_progress is not None:
        out.append(f"batches in progress: {in_progress}")
    out.append(f"batches finalized by this router: {batch.get('finalized', 0)}")


def _status_replicas(doc: dict[str, Any], out: list[str]) -> None:
    """Replicas desired and running per deployment, with the autoscaler's reason."""
    replicas = _map(doc, "replicas")
    if replicas:
        out.append("replicas (desired / running):")
        for dep, r in replicas.items():
            line = f"  {dep}: {_num(r.get('desired'))} / {_num(r.get('running'))}"
            auto = _map(r, "autoscale")
            if auto:
                line += f"  [{auto.get('reason') or auto.get('mode')}"
                if auto.get("recycle_surge"):
                    line += f", +{auto['recycle_surge']} recycle surge"
                line += "]"
            out.append(line)


def _status_deployments(doc: dict[str, Any], out: list[str]) -> None:
    """Deployments Serve does not call healthy, with its replicas by state and its message:
    a replica it cannot place yet (its placement group pending) says so, and why."""
    unwell = {name: d for name, d in _map(doc, "deployments").items() if d.get("status") != "HEALTHY"}
    if not unwell:
        return
    out.append("deployments not healthy (Serve's word):")
    for name, d in sorted(unwell.items()):
        states = ", ".join(f"{n} {s}" for s, n in sorted(_map(d, "replicas").items())) or "no replicas"
        out.append(f"  {name}: {d.get('status', '?')} ({states})")
        if d.get("message"):
            out.append(f"    {d['message']}")


def _status_quotas(doc: dict[str, Any], out: list[str], near_quota_ratio: float) -> None:
    """Tenants near their quota."""
    near = [
        (t, q)
        for t, q in sorted(_map(doc, "quotas").items())
        if q.get("burst_tokens") and q.get("tokens", 0) <= near_quota_ratio * q["burst_tokens"]
    ]
    out.append(f"tenants near their quota (bucket <= {near_quota_ratio:.0%} of burst): {len(near) if near else 'none'}")
    for t, q in near:
        lease = "" if q.get("lease", True) else ", no lease (safe share)"
        out.append(
            f"  {t}: {q.get('tokens')} of {q.get('burst_tokens')} tokens, refills {q.get('rate_tokens_per_s')}/s{lease}"
        )


def _status_actions(doc: dict[str, Any], out: list[str]) -> None:
    """Recycles in flight and kill switches."""
    recycle = _map(doc, "recycle")
    in_flight = recycle.get("in_flight") or []
    out.append(f"recycles in flight: {len(in_flight) if in_flight else 'none'}")
    for f in in_flight:
        out.append(
            f"  {f.get('replica_id')} ({f.get('deployment')}): {f.get('reason')}, {_num(f.get('age_s'), '.0f')} s"
        )
    if recycle.get("waiting"):
        out.append(f"  waiting: {len(recycle['waiting'])}")

    switches = doc.get("kill_switches") or []
    out.append(f"kill switches: {len(switches) if switches else 'none'}")
    for k in switches:
        scope = k.get("scope", "?") + (f"={k['value']}" if k.get("value") else "")
        out.append(f"  {scope}: {k.get('reason')} (by {k.get('set_by')}, id {k.get('id')})")


def tenant_rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``ballast tenants``: one row per tenant, its quota fields and, for each model whose
    gate orders tenants, its fair-share fields there (``fair_shares``: model -> counter,
    service per second, waiting, and whose counters: the cluster's or this router's own)."""
    rows = {t: dict(q) for t, q in _map(doc, "quotas").items()}
    for model in model_names(doc):
        fair = _map(doc, "models", model, "gate", "fairness")
        if not fair:
            continue
        waiting = set(fair.get("backlogged") or ())
        served = _map(fair, "served_per_s")
        for t, counter in _map(fair, "counters").items():
            shares = rows.setdefault(t, {}).setdefault("fair_shares", {})
            shares[model] = {
                "counter": counter,
                "served_per_s": served.get(t),
                "waiting": t in waiting,
                "view": fair.get("view"),
            }
    return rows
