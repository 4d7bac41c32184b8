"""What a generation request may say: every field the Python API, the CLI and the server accept, and its range.

One table, so that the three doors check the same thing, and so that nothing a request carries can fail later
inside a compiled program or a running batch (a seed outside uint32 used to fail only when the batch's random
key was made, and took the other requests of that batch with it). Each range is the one the engine really
accepts: seeds become a ``uint32``, temperatures a ``float32``, budgets a static tree size. Lengths depend on
the model and the server (context, ``--max-new-tokens``) and are checked where those are known
(``Model.prepare``, ``Batcher.check``); token ids against the vocabulary in ``Model.encode``.

Imports nothing heavy: the CLI checks its flags with it before JAX is loaded.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable

METHODS = ("ar", "dflash", "ddtree")
SEED_MAX = 2**32 - 1            # the engine's key is made from a uint32
TEMPERATURE_MAX = 1e4           # float32-safe; OpenAI's own limit (2) is the server's, see serving/server.py
TOP_K_MAX = 2**31 - 1           # an int32 (a top_k above the vocabulary keeps every token)
PENALTY_MAX = 2.0               # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
REPETITION_MAX = 100.0          # HF's repetition_penalty: any positive number; 100 already all but bans a token
LOGIT_BIAS_MAX = 100.0          # OpenAI: each logit_bias value in [-100, 100]
LOGIT_BIAS_ENTRIES = 300        # OpenAI: at most 300 entries; also the engine's static slots per row


class GenerationError(ValueError):
    """Bad generation arguments (a field out of range, lengths, budget, token ids); the message names the fix."""


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _in(lo, hi, lo_open=False):
    return lambda v: _is_number(v) and (lo < v if lo_open else lo <= v) and v <= hi


def token_id(key):
    """A logit_bias key as a token id: an int, or its decimal string (JSON object keys are strings); else None."""
    if isinstance(key, str) and key.isdigit():
        return int(key)
    return key if _is_int(key) and key >= 0 else None


def _is_logit_bias(v) -> bool:
    return (isinstance(v, dict) and len(v) <= LOGIT_BIAS_ENTRIES
            and all(token_id(k) is not None and _in(-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX)(b) for k, b in v.items()))


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    accepts: str                       # the range, as the error message says it
    valid: Callable[[object], bool]
    default: object                    # what None means (None: the field is required)


FIELDS = {f.name: f for f in (
    Field("max_new_tokens", "an integer >= 1", lambda v: _is_int(v) and v >= 1, None),
    Field("method", f"one of {', '.join(METHODS)}", lambda v: v in METHODS, "ddtree with a drafter, else ar"),
    Field("budget", "'auto' or an integer >= 0 (tree nodes)", lambda v: v == "auto" or (_is_int(v) and v >= 0),
          "auto"),
    Field("temperature", f"a finite number in [0, {TEMPERATURE_MAX:g}] (0 is greedy)",
          lambda v: _is_number(v) and 0 <= v <= TEMPERATURE_MAX, 0.0),
    Field("seed", f"an integer in [0, {SEED_MAX}] (a uint32)", lambda v: _is_int(v) and 0 <= v <= SEED_MAX, 0),
    Field("block_size", "an integer >= 2 (at most the drafter's block)", lambda v: _is_int(v) and v >= 2,
          "the drafter's block"),
    # The logits processors (kimi_jax.decoding.processors); each default leaves the distribution as it is.
    Field("top_k", f"an integer in [0, {TOP_K_MAX}] (0 keeps every token)",
          lambda v: _is_int(v) and 0 <= v <= TOP_K_MAX, 0),
    Field("top_p", "a finite number in (0, 1] (1 keeps every token)", _in(0.0, 1.0, lo_open=True), 1.0),
    Field("min_p", "a finite number in [0, 1] (0 keeps every token)", _in(0.0, 1.0), 0.0),
    Field("presence_penalty", f"a finite number in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}]", _in(-PENALTY_MAX, PENALTY_MAX),
          0.0),
    Field("frequency_penalty", f"a finite number in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}]",
          _in(-PENALTY_MAX, PENALTY_MAX), 0.0),
    Field("repetition_penalty", f"a finite number in (0, {REPETITION_MAX:g}] (1 is none)",
          _in(0.0, REPETITION_MAX, lo_open=True), 1.0),
    Field("logit_bias", f"a map of at most {LOGIT_BIAS_ENTRIES} token ids to numbers in [-{LOGIT_BIAS_MAX:g}, "
          f"{LOGIT_BIAS_MAX:g}]", _is_logit_bias, {}),
)}
LOGPROBS_MAX = 20              # OpenAI's top_logprobs limit
FIELDS["logprobs"] = Field("logprobs", f"an integer in [0, {LOGPROBS_MAX}] (the alternatives per token)",
                           lambda v: _is_int(v) and 0 <= v <= LOGPROBS_MAX, 0)
PROCESSORS = ("top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")


def check(**values) -> None:
    """Raise GenerationError for the first value outside its field's range; None means the field's default."""
    for name, value in values.items():
        field = FIELDS[name]
        if value is None and field.default is not None:
            continue
        if not field.valid(value):
            raise GenerationError(f"{name} must be {field.accepts}, got {value!r}")
