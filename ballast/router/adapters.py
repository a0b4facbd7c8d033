"""The router's catalog: the config's, with the LoRA adapters operators added at run time
(the snapshot's ``adapters``) on top.

``runtime_catalog`` is applied by the reporter to each new snapshot and by the admin
routes to check an adapter before it is loaded. An entry that is malformed or no longer
fits the config (its model gone in a redeploy, its name now the config's) is skipped with
a warning and never raised: the snapshot loop and the request path go on with the rest.
The rules are ``ballast.policies.adapters.with_runtime``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ballast.policies.adapters import parse_runtime, with_runtime
from ballast.policies.catalog import Catalog

log = logging.getLogger("ballast.router")


def runtime_catalog(base: Catalog, entries: Sequence[Any]) -> Catalog:
    """``base`` with the snapshot's run-time adapters that fit it (the others skipped, logged)."""
    parsed, malformed = parse_runtime(entries)
    for raw, why in malformed:
        log.warning("ignoring a malformed run-time adapter %r: %s", raw, why)
    catalog, skipped = with_runtime(base, parsed)
    for entry, reason in skipped:
        log.warning("run-time adapter %r on %r skipped: %s", entry.name, entry.model, reason)
    return catalog
