"""The catalog: which models and LoRA adapters are served, what a request's ``model``
names, who may use what, and what one token costs.

Built once from plain data (``BallastConfig.catalog()``), never from pydantic objects;
adapters added or removed at run time give a new catalog (``with_adapter`` /
``without_adapter``), the old one unchanged, so a router swaps one reference.

Names. Model and adapter names share one namespace: unique across both, 1-64 of
``A-Z a-z 0-9 . _ - / + @ =``. A request names a model (``llama``), an adapter (``sql``)
or an adapter as ``ray.serve.llm`` names it (``llama:sql``); the last two resolve to the
same adapter. A name goes whole into HAProxy's maps and admin-socket commands
(ballast/router/edge.py), where whitespace ends a word, ``;`` a command, a backslash escapes
and ``#`` starts a comment; the few characters allowed hold there.

Grants (deny unless allowed, but nothing written allows everything). A tenant may use
a name when all three hold:

- the model's ``tenants`` name it, or the model has none;
- for an adapter, the adapter's ``tenants`` name it, or the adapter has none (an
  adapter cannot widen its model's: its tenants are a subset of the model's);
- the tenant's own ``models`` list names it, or the tenant has none. Naming a model
  there covers the model and its adapters (one added at run time included); naming
  an adapter covers that adapter alone.

A name that is unknown and one that is forbidden answer the same (``target_for`` gives
None, ``may_use`` False, ``listed_for`` leaves it out), so a caller cannot learn what
others are served.

Written by hand: this is a few dictionaries and set intersections with Ballast's own
rules; no library holds them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ballast.policies.engines import ENGINES

MAX_NAME_CHARS = 64
NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-/+@=")


def _serves_lora(backend: str) -> bool:
    """Whether the engine ``backend`` names serves LoRA adapters (``engines.ENGINES``)."""
    engine = ENGINES.get(backend)
    return engine is not None and engine.lora


class CatalogError(ValueError):
    """A catalog that cannot be built, or a run-time change it refuses: ``field`` names
    what was wrong (an admin call's field, or the part of the catalog)."""

    def __init__(self, field: str, reason: str):
        super().__init__(field, reason)
        self.field = field
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}"


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a model or an adapter, or None when it can."""
    if not name or len(name) > MAX_NAME_CHARS:
        return f"{name!r} must be 1-{MAX_NAME_CHARS} characters"
    if ":" in name:
        return f"{name!r} may not hold ':' (a request names an adapter as <model>:<adapter>)"
    odd = sorted(set(name) - NAME_CHARS)
    if odd:
        return (
            f"{name!r} may hold only letters, digits and . _ - / + @ =, not {''.join(odd)!r} "
            "(a name goes whole into the edge's HAProxy maps and commands)"
        )
    return None


def _tenant_set(tenants: Iterable[str] | None) -> frozenset[str] | None:
    return None if tenants is None else frozenset(tenants)


@dataclass(frozen=True)
class AdapterEntry:
    """A LoRA adapter: a local directory, and the tenants that may use it (None: every
    tenant its model admits)."""

    name: str
    path: str
    tenants: frozenset[str] | None = None


@dataclass(frozen=True)
class ModelEntry:
    """A served model: its engine, its cost per token in a tenant's bucket and fair share,
    the tenants that may use it (None: every tenant) and its adapters, in order."""

    name: str
    backend: str
    cost_per_token: float = 1.0
    tenants: frozenset[str] | None = None
    adapters: tuple[AdapterEntry, ...] = ()


@dataclass(frozen=True)
class Target:
    """What a request's ``model`` field resolves to: the model to run and the adapter to
    run it with (None: the base model)."""

    model: str
    adapter: str | None = None

    @property
    def name(self) -> str:
        """The name the catalog lists: the adapter's, else the model's."""
        return self.adapter if self.adapter is not None else self.model


@dataclass(frozen=True)
class Listed:
    """One line of ``GET /v1/models``: an id, and for an adapter its base model (vLLM's
    ``parent``)."""

    id: str
    parent: str | None = None


@dataclass(frozen=True)
class Catalog:
    """Models (in config order, the first the primary) and the tenants' own lists.

    ``tenant_models``: every declared tenant with the names it may use (None: any). A
    grant may name only declared tenants; a caller that is no declared tenant has no
    list of its own. Invariants checked on construction: names valid and unique across
    models and adapters, adapters only on vLLM models, costs > 0, adapter tenants within
    their model's, every granted tenant declared, every name in a tenant's list known.
    """

    models: tuple[ModelEntry, ...]
    tenant_models: tuple[tuple[str, frozenset[str] | None], ...] = ()
    # Indexes built from the fields above (not compared, not given).
    _models: dict[str, ModelEntry] = field(init=False, repr=False, compare=False)
    _adapters: dict[str, tuple[ModelEntry, AdapterEntry]] = field(init=False, repr=False, compare=False)
    _own: dict[str, frozenset[str] | None] = field(init=False, repr=False, compare=False)

    @classmethod
    def build(
        cls, models: Sequence[ModelEntry], tenant_models: Mapping[str, Iterable[str] | None] | None = None
    ) -> Catalog:
        """A catalog from models and ``{tenant: names it may use, or None}``."""
        own = tuple((t, _tenant_set(names)) for t, names in (tenant_models or {}).items())
        return cls(tuple(models), own)

    def __post_init__(self) -> None:
        if not self.models:
            raise CatalogError("models", "at least one model")
        object.__setattr__(self, "_models", {})
        object.__setattr__(self, "_adapters", {})
        for model in self.models:
            self._index(model)
        object.__setattr__(self, "_own", {})
        for tenant, names in self.tenant_models:
            self._own[tenant] = None if names is None else self._canonical(tenant, names)

    # -- construction checks ---------------------------------------------------------
    def _index(self, model: ModelEntry) -> None:
        self._check_name("models", model.name)
        if not model.cost_per_token > 0:
            raise CatalogError(f"{model.name}.cost_per_token", "must be > 0")
        if model.adapters and not _serves_lora(model.backend):
            raise CatalogError(
                f"{model.name}.adapters", f"LoRA adapters are vLLM's (backend 'vllm'); this is {model.backend!r}"
            )
        self._check_tenants(f"{model.name}.tenants", model.tenants, None)
        self._models[model.name] = model
        for adapter in model.adapters:
            self._check_adapter(model, adapter)
            self._adapters[adapter.name] = (model, adapter)

    def _check_adapter(self, model: ModelEntry, adapter: AdapterEntry) -> None:
        self._check_name(f"{model.name}.adapters", adapter.name)
        if not adapter.path:
            raise CatalogError(f"{model.name}.adapters.{adapter.name}.path", "a local directory is required")
        self._check_tenants(f"{model.name}.adapters.{adapter.name}.tenants", adapter.tenants, model)

    def _check_name(self, where: str, name: str) -> None:
        problem = name_problem(name)
        if problem is not None:
            raise CatalogError(where, problem)
        if name in self._models or name in self._adapters:
            raise CatalogError(where, f"{name!r} is taken (model and adapter names are unique across both)")

    def _check_tenants(self, where: str, tenants: frozenset[str] | None, model: ModelEntry | None) -> None:
        if tenants is None:
            return
        if not tenants:
            raise CatalogError(where, "names no tenant (leave it out to let every tenant in)")
        declared = {t for t, _ in self.tenant_models}
        unknown = sorted(tenants - declared)
        if unknown:
            raise CatalogError(where, f"{unknown} are not declared tenants")
        if model is not None and model.tenants is not None and not tenants <= model.tenants:
            raise CatalogError(where, f"{sorted(tenants - model.tenants)} may not use model {model.name!r}")

    def _canonical(self, tenant: str, names: frozenset[str]) -> frozenset[str]:
        """A tenant's list as model and adapter names (``model:adapter`` made ``adapter``)."""
        out: set[str] = set()
        for name in names:
            target = self.resolve(name)
            if target is None:
                raise CatalogError(f"tenants.{tenant}.models", f"{name!r} is no model or adapter")
            out.add(target.name)
        return frozenset(out)

    # -- questions -------------------------------------------------------------------
    def resolve(self, name: str) -> Target | None:
        """The model and adapter ``name`` means ("llama", "sql", "llama:sql"), or None."""
        if name in self._models:
            return Target(name)
        if name in self._adapters:
            return Target(self._adapters[name][0].name, name)
        model, sep, adapter = name.partition(":")
        if sep and adapter in self._adapters and self._adapters[adapter][0].name == model:
            return Target(model, adapter)
        return None

    def may_use(self, tenant: str, name: str) -> bool:
        """Whether ``tenant`` may use ``name``; False alike for unknown and forbidden names."""
        return self.target_for(tenant, name) is not None

    def target_for(self, tenant: str, name: str) -> Target | None:
        """What ``name`` means for ``tenant``: None when it is unknown or forbidden alike
        (the router answers both 404 model_not_found)."""
        target = self.resolve(name)
        if target is None:
            return None
        model = self._models[target.model]
        if model.tenants is not None and tenant not in model.tenants:
            return None
        if target.adapter is not None:
            adapter = self._adapters[target.adapter][1]
            if adapter.tenants is not None and tenant not in adapter.tenants:
                return None
        own = self._own.get(tenant)
        if own is not None and target.model not in own and target.name not in own:
            return None
        return target

    def listed_for(self, tenant: str) -> tuple[Listed, ...]:
        """What ``GET /v1/models`` shows ``tenant``: each model and adapter it may use, in
        config order, an adapter right after its model, with its model as ``parent``."""
        out: list[Listed] = []
        for model in self.models:
            if self.may_use(tenant, model.name):
                out.append(Listed(model.name))
            out.extend(Listed(a.name, model.name) for a in model.adapters if self.may_use(tenant, a.name))
        return tuple(out)

    def cost_per_token(self, name: str) -> float:
        """What one token of ``name`` costs in a tenant's bucket and fair share (an
        adapter costs its model's)."""
        target = self.resolve(name)
        if target is None:
            raise CatalogError("model", f"{name!r} is no model or adapter")
        return self._models[target.model].cost_per_token

    def open_names(self) -> dict[str, str]:
        """Every name any caller may use, whatever its key -> its model: the models and
        adapters no ``tenants`` list and no tenant's own ``models`` list leaves anyone out
        of, an adapter also as ``model:adapter``. What is said about one of these names
        before a key is checked (HAProxy's edge) tells no caller what others are served."""
        out: dict[str, str] = {}
        for model in self.models:
            if model.tenants is None and self._everyones(model.name, model.name):
                out[model.name] = model.name
            for a in model.adapters:
                if model.tenants is None and a.tenants is None and self._everyones(model.name, a.name):
                    out[a.name] = out[f"{model.name}:{a.name}"] = model.name
        return out

    def _everyones(self, model: str, name: str) -> bool:
        """Whether every tenant's own list (where it has one) covers ``name`` of ``model``."""
        return all(own is None or model in own or name in own for own in self._own.values())

    @property
    def primary(self) -> ModelEntry:
        return self.models[0]

    # -- run-time changes ------------------------------------------------------------
    def with_adapter(self, model: str, name: str, path: str, tenants: Iterable[str] | None = None) -> Catalog:
        """A new catalog with adapter ``name`` (directory ``path``) on ``model``, for
        ``tenants`` (None: every tenant the model admits). Refused: an unknown model, a
        model not served by vLLM, a name taken, a tenant undeclared or not admitted by
        the model."""
        base = self._models.get(model)
        if base is None:
            raise CatalogError("model", f"{model!r} is no model served here")
        if not _serves_lora(base.backend):
            raise CatalogError("model", f"{model!r} is served by {base.backend!r}; LoRA adapters are vLLM's")
        problem = name_problem(name)
        if problem is not None:
            raise CatalogError("name", problem)
        if name in self._models or name in self._adapters:
            raise CatalogError("name", f"{name!r} is taken (model and adapter names are unique across both)")
        if not path:
            raise CatalogError("path", "a local directory is required")
        adapter = AdapterEntry(name, path, _tenant_set(tenants))
        try:
            self._check_tenants("tenants", adapter.tenants, base)
        except CatalogError as e:
            raise CatalogError("tenants", e.reason) from None
        grown = dataclasses.replace(base, adapters=base.adapters + (adapter,))
        return dataclasses.replace(self, models=tuple(grown if m is base else m for m in self.models))

    def without_adapter(self, name: str) -> Catalog:
        """A new catalog without the adapter ``name`` (or ``model:adapter``); refused for a
        name that is no adapter. It leaves the tenants' own lists too: a list that named
        only it then grants nothing (never everything), and an adapter added again under
        that name is granted by the lists that name its model."""
        target = self.resolve(name)
        if target is None or target.adapter is None:
            raise CatalogError("name", f"{name!r} is no adapter")
        base = self._models[target.model]
        shrunk = dataclasses.replace(base, adapters=tuple(a for a in base.adapters if a.name != target.adapter))
        models = tuple(shrunk if m is base else m for m in self.models)
        own = tuple((t, None if n is None else n - {target.adapter}) for t, n in self.tenant_models)
        return dataclasses.replace(self, models=models, tenant_models=own)
