"""The sampling values every engine takes alike, decided once: below which temperature a
row is greedy, the integers an engine takes and the seeds' range. The fronts serve a
request by them (``ballast.router.openai_api``; a body's integers, ``ballast.router.api``),
and a row's sampling (``ballast.model.protocol.RowSampling``) holds to them on its way to
any engine.
"""

from __future__ import annotations

import math

#: Below this a temperature samples the argmax anyway (a logit gap of 0.001 becomes a
#: factor e^100), and logits / temperature heads for overflow (float16 ends at 65504):
#: such a temperature is served as 0, greedy.
GREEDY_BELOW_TEMPERATURE = 1e-5

#: The integers every engine takes: int64 (vLLM's and torch's widest). A request body's
#: integers are bounded by it wherever they appear.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

#: Seeds as every engine takes them: any int64 (OpenAI's and vLLM's range; torch's
#: generators take any int64 and wrap a negative one).
MIN_SEED, MAX_SEED = INT64_MIN, INT64_MAX


def sampling_temperature(asked: float) -> float:
    """The temperature the engines are sent: ``asked``, or 0 (greedy) below
    ``GREEDY_BELOW_TEMPERATURE``. ``asked`` is finite and >= 0 (checked where it is read)."""
    if not math.isfinite(asked) or asked < 0:
        raise ValueError(f"temperature: must be a finite number >= 0, got {asked!r}")
    return 0.0 if asked < GREEDY_BELOW_TEMPERATURE else asked
