"""Stop strings across chunk boundaries: never emitted, found wherever the pieces split."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from zctl.engine.stops import StopMatcher, first_stop, held_suffix


def run(pieces: list[str], stops: list[str]) -> tuple[str, str | None]:
    matcher = StopMatcher(stops)
    out = "".join(matcher.push(p) for p in pieces) + matcher.flush()
    return out, matcher.hit


def test_held_suffix_and_first_stop() -> None:
    assert held_suffix("hello wor", ["world"]) == 3
    assert held_suffix("hello", ["world"]) == 0
    assert held_suffix("abab", ["abc"]) == 2  # "ab" could still become "abc"
    assert first_stop("one STOP two END", ["END", "STOP"]) == (4, "STOP")
    assert first_stop("nothing", ["x"]) is None


def test_a_stop_split_over_pieces_is_cut_and_the_rest_dropped() -> None:
    assert run(["Hello ", "wo", "rld", " after"], ["world"]) == ("Hello ", "world")
    assert run(["a", "b"], ["abc"]) == ("ab", None)  # never completed: flushed at the end


def test_a_stop_that_starts_first_wins_over_one_that_completes_first() -> None:
    assert run(["ba", "a"], ["a", "baa"]) == ("", "baa")  # as if "baa" came in one piece
    assert run(["ba", "ax"], ["a", "bab"]) == ("b", "a")  # "bab" never came: "a" it is
    assert run(["ba"], ["a", "baa"]) == ("b", "a")  # the end settles it


def test_nothing_is_sent_early_that_could_be_a_stop() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.push("text </") == "text "
    assert matcher.push("p>") == "</p>"


alphabet = st.text(alphabet="abc ", max_size=30)


@given(alphabet, st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=4),
       st.lists(st.integers(0, 30), max_size=6))
def test_any_split_gives_the_text_before_the_first_stop(text: str, stops: list[str],
                                                        cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    found = first_stop(text, stops)
    want = text if found is None else text[:found[0]]
    out, hit = run(pieces, stops)
    assert out == want and (hit is None) == (found is None)
    assert hit is None or text[len(want):].startswith(hit)  # ties: any stop starting there
