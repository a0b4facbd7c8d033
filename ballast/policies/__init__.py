"""Pure decision policies for Ballast.

Everything in this package is a function (or a small frozen dataclass) of its
inputs and an explicit state: no Ray, torch, NVML, HTTP or metrics imports, and
time is always passed in (``now_s``) or injected (``clock``), never read from a
module-level clock. ``ballast`` adapts these policies to Ray Serve; the load
test fleet simulator drives the very same objects.
"""
