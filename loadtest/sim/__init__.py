"""Fleet simulator: Ballast's production policies over a day of a 1,000-replica fleet.

``simulate(SimConfig(), arm, seed) -> Result`` runs one arm; ``python -m
loadtest.sim`` runs all four on the same seeded arrivals and prints the
comparison (``make sim``). Arms (``ARMS``):

* ``ballast`` — ``ballast.policies.degradation`` + ``ballast.policies.admission`` (shedding by
  criticality, batch and ``max_tokens`` constraints), ``ballast.policies.autoscale``,
  the watchdog ladder (``ballast.policies.leak.assess``) and staggered recycling
  (``ballast.policies.recycle.recycle_step`` under ``ballast.policies.lease`` leases, with the
  recycle surge), through the controller's own policy code (``ballast.policies.control``;
  ``controllers.BallastController`` keeps no copy of the controller's tick);
* ``ballast_no_recycle`` — the same without watchdog and recycling: leaks run to OOM;
* ``ray_serve_default`` — Ray Serve's queue-length autoscaling, no shedding;
* ``hpa_utilization`` — a Kubernetes-HPA utilization rule, no shedding.

**Model, and what it leaves out** (details in each module):

* time-stepped at the control tick (default 1 s; production ticks every 0.5 s); requests are integer
  cohorts per criticality per tick, not individual events, so a day of
  ~800 million requests fits in seconds; arrivals are Poisson around a
  diurnal curve with an evening flash crowd (``model.LoadProfile``);
* the fleet is one pool of batch slots behind even routing, served FIFO as a
  fluid (``fleet.RequestQueue``): queueing below saturation is ignored, which
  for a thousand replicas of 32 slots each is negligible until ~99 % busy;
* service time per request ``work × (t0 + t1·b)`` for batch ``b``
  (``model.ServiceModel``); latency = queue wait + service time; SLO 1 s;
  unserved requests give up after 30 s;
* replicas: 60–120 s cold start (paid for, serving nothing), exponential hard
  failures, 10 % leak host memory linearly to an OOM-kill (time to OOM
  lognormal, median 8 h); a death loses the replica's running batch;
  hangs are not modelled;
* no GPU-utilization or VRAM signal is reported (leaks are in host RSS), so
  Ballast's autoscaler and degradation run on concurrency, queue length,
  queue wait and error rate; the HPA baseline reads a replica's throughput
  over its saturated throughput as its utilization;
* the watchdog's leak trend is computed analytically from the known leak
  (noise-free: R² = 1) rather than fitted by ``LeakDetector`` per sample;
* absolute-count settings are scaled to the fleet (``config.fleet_scaled_settings``);
* tenants are off by default: then requests have none and the fleet serves one FIFO
  with no class order. With ``SimConfig.tenancy`` they belong to tenants and wait at
  routers' gates, most critical class first and, inside a class, in fair-share order
  by ``ballast.policies.fairness`` (``tenants``); ``python -m loadtest.sim.fairness``
  runs that scenario (``make sim-fairness``).

Deterministic for a seed: arrivals and each arm's fleet draw from numpy
generators seeded from it; the arms' results do not depend on each other.
"""

from .config import ARMS, BALLAST, BALLAST_NO_RECYCLE, HPA, RAY_SERVE, SimConfig
from .engine import ClassStats, Result, TickRecord, arrivals, simulate

__all__ = [
    "ARMS",
    "BALLAST",
    "BALLAST_NO_RECYCLE",
    "HPA",
    "RAY_SERVE",
    "ClassStats",
    "Result",
    "SimConfig",
    "TickRecord",
    "arrivals",
    "simulate",
]
