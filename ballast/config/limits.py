"""``limits``: what one request may ask, in size and in the work it causes."""

from __future__ import annotations

from pydantic import Field, PositiveInt

from ballast.config.base import Strict
from ballast.policies.schema import SchemaBounds


class LimitsConfig(Strict):
    """What one request may ask (docs/api.md, "Limits"); past a bound, a 4xx naming the field."""

    max_body_bytes: PositiveInt = 64 * 1024
    max_prompt_bytes: PositiveInt = 16 * 1024
    max_tokens_limit: PositiveInt = 8192
    # Arrays and objects nested in a body. The deepest real body is a schema inside
    # response_format or a tool (4-5 levels down, itself at most max_schema_depth);
    # the parse, validation and serializers recurse once per level, Python's limit is 1000.
    max_json_depth: int = Field(default=64, ge=8, le=256)
    # Choices one request may ask for (OpenAI's ``n``): each is a row at the model that
    # may run to max_tokens, charged to the quota and the gate's fair share as such.
    max_choices: int = Field(default=8, ge=1, le=128)
    # Characters in one stop string (at most 4 strings, OpenAI's limit). Stops are
    # markers ("\n\n", "</answer>", "User:"); the held-back check on each streamed piece
    # grows with the square of the longest stop, on the router's and the replica's loops.
    max_stop_chars: int = Field(default=256, ge=1, le=4096)
    # A schema guided decoding compiles (response_format, a tool's parameters, the array
    # tool_choice "required" builds over every tool): its nesting, and its nodes (every
    # object, array and value). OpenAI allows 10 levels of nested objects (~20 JSON levels).
    # 4096 nodes take ~0.4 s to compile on one core with a 32k vocabulary.
    max_schema_depth: int = Field(default=32, ge=2, le=128)
    max_schema_nodes: int = Field(default=4096, ge=16, le=1_000_000)
    # What else the grammar spells out (ballast/policies/schema.py): each pattern, as written
    # and with its counted repetitions unrolled ("(.{1,16}){1,16}" is 256); the counts the
    # schema asks (minLength, maxLength, minItems, maxItems, min/maxProperties; each schema
    # object its largest), summed; the characters of its property and definition names, enum
    # and const strings and patterns, summed (OpenAI's own bound on names and values is 120,000).
    # The tools' schemas count together. Within these a schema can still compile slowly (an
    # ambiguous pattern grows much faster than its size): the replica's compile time limit
    # and its threads' share per tenant (model.grammar_compile_*) answer for that.
    max_schema_pattern_chars: int = Field(default=128, ge=8, le=4096)
    max_schema_repeat: int = Field(default=1024, ge=16, le=1_000_000)
    max_schema_literal_chars: int = Field(default=32768, ge=256, le=1 << 20)

    def schema_bounds(self) -> SchemaBounds:
        return SchemaBounds(
            max_depth=self.max_schema_depth,
            max_nodes=self.max_schema_nodes,
            max_repeat=self.max_schema_repeat,
            max_pattern_chars=self.max_schema_pattern_chars,
            max_literal_chars=self.max_schema_literal_chars,
        )
