"""The logprobs objects: a token the engine gives no probability (log -inf) is written as vLLM's server does."""

from __future__ import annotations

import json
import math

from gateway.responses import MIN_LOGPROB, CompletionLogprobs, chat_logprobs
from gateway.tokenizer import ByteTokenizer
from llumlet.engine.types import TokenLogprobs

# a guided-decoding grammar allowed only "{" (id 123 + 3): it has probability 1, everything else none
ENTRY = TokenLogprobs(0.0, ((126, 0.0), (3, -math.inf)))


def test_minus_infinity_is_written_as_the_smallest_logprob_in_both_formats() -> None:
    tok = ByteTokenizer()
    legacy = CompletionLogprobs(tok).chunk([126], [ENTRY])
    chat = chat_logprobs(tok, [126], [TokenLogprobs(-math.inf, ((126, -math.inf),))])
    for body in (legacy, chat):
        json.dumps(body, allow_nan=False)  # valid JSON: no -Infinity
    assert legacy["token_logprobs"] == [0.0] and list(legacy["top_logprobs"][0].values()) == [0.0, MIN_LOGPROB]
    assert chat["content"][0]["logprob"] == MIN_LOGPROB == -9999.0
    assert chat["content"][0]["top_logprobs"][0]["logprob"] == MIN_LOGPROB
