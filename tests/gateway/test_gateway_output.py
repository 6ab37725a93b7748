"""ChoiceOutput: stop strings matched on the detokenized text, cut as OpenAI does, held back in streams until
resolved, counted after min_tokens; the tokens kept are the ones up to the match."""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.output import ChoiceOutput, Piece
from gateway.tokenizer import ByteTokenizer
from llumlet.engine.types import TokenLogprobs

BYTES = ByteTokenizer()


def ids(text: str) -> list[int]:
    return list(BYTES.encode(text))


def out(stop: Sequence[str] = (), **kw: object) -> ChoiceOutput:
    return ChoiceOutput(BYTES.detokenizer(()), tuple(stop), **kw)  # type: ignore[arg-type]


def run(o: ChoiceOutput, tokens: list[int], chunk: int = 1) -> list[Piece]:
    """Push ``tokens`` ``chunk`` at a time until the output stops; finish it if it did not."""
    pieces = []
    for i in range(0, len(tokens), chunk):
        pieces.append(o.push(tokens[i : i + chunk]))
        if o.stopped is not None:
            return pieces
    pieces.append(o.finish())
    return pieces


def test_stop_string_cut_before_it_and_tokens_after_it_dropped() -> None:
    o = out(["STOP"])
    pieces = run(o, ids("Hello STOP more"))
    assert "".join(p.text for p in pieces) == "Hello " == o.text
    assert o.stopped == "STOP" and pieces[-1].stopped == "STOP"
    assert o.token_ids == ids("Hello STOP")  # up to the token that completed the match; " more" never counted


def test_a_stream_never_shows_the_start_of_a_stop_string_until_it_is_resolved() -> None:
    o = out(["</answer>"])
    shown = [o.push([t]).text for t in ids("x </ans")]
    assert "".join(shown) == "x "  # "</ans" could still become "</answer>": held
    assert o.push(ids("wer-no")).text == "</answer-no"  # resolved: not the stop string, released at once
    assert o.finish().text == ""
    o = out(["</answer>"])
    shown = [o.push([t]).text for t in ids("x </ans")]
    assert o.finish().text == "</ans"  # the output ended: what was held is the answer's end


def test_include_stop_str_in_output_and_earliest_completing_stop_wins() -> None:
    o = out(["world!", "lo w"], include_stop_str_in_output=True)
    run(o, ids("Hello world!"), chunk=4)  # "Hell" "o wo": "lo w" completes first
    assert (o.text, o.stopped) == ("Hello w", "lo w")
    o = out(["bc", "abcd"])
    run(o, ids("xabcd"), chunk=5)  # one push completes both: "bc" ends first
    assert (o.text, o.stopped, o.token_ids) == ("xa", "bc", ids("xabc"))
    o = out(["<", "><"])
    run(o, ids("x><"))  # both complete with the last token: cut before the one that starts first
    assert (o.text, o.stopped) == ("x", "><")


def test_stop_strings_count_only_after_min_tokens() -> None:
    o = out(["a"], min_tokens=3)
    run(o, ids("aaaaa"))
    assert (o.text, o.stopped, len(o.token_ids)) == ("aaa", "a", 4)  # the 4th token is the first that may stop


def test_logprobs_follow_the_tokens_kept() -> None:
    o = out(["!"])
    tokens = ids("ok! no")
    lps = [TokenLogprobs(-float(i)) for i in range(len(tokens))]
    piece = o.push(tokens, lps)
    assert piece.token_ids == tuple(ids("ok!")) and [e.logprob for e in piece.logprobs] == [0.0, -1.0, -2.0]
    assert o.push(ids("later")) == Piece("", ())  # ignored once stopped


def test_no_stop_strings_releases_everything_at_once() -> None:
    o = out()
    assert o.push(ids("abc")).text == "abc"
    assert o.finish() == Piece("", (), (), None)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab!<>x", max_size=30),
    stops=st.lists(st.text(alphabet="ab!<>", min_size=1, max_size=4), min_size=1, max_size=3),
    seed=st.integers(0, 1000),
)
def test_any_chunking_gives_the_reference_answer_and_never_shows_text_it_takes_back(
    text: str, stops: list[str], seed: int
) -> None:
    """The released text equals the text cut at the earliest-completing stop string, however tokens arrive,
    and every prefix of it a stream showed is a prefix of that final answer."""
    ends = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    first_end = min((e for e, _, _ in ends), default=None)
    expected = text if first_end is None else text[: min(i for e, i, _ in ends if e == first_end)]
    rng = random.Random(seed)
    o = out(dict.fromkeys(stops))
    tokens, shown = ids(text), ""
    i = 0
    while i < len(tokens) and o.stopped is None:
        n = rng.randint(1, 4)
        shown += o.push(tokens[i : i + n]).text
        assert expected.startswith(shown)
        i += n
    if o.stopped is None:
        shown += o.finish().text
    assert shown == expected == o.text
