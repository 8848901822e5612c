"""Stop strings over a token stream (``serving.stops.TextStream``) with the real streaming
detokenizer on a fake vocabulary: no model, no llama.cpp.

What a client sees: text that could still become a stop string is held back, a stop string
may span tokens (and start in the middle of one), a character split across tokens comes out
whole, and the concatenated stream equals the final text, which ends before the stop."""

from __future__ import annotations

import random

import pytest

from pyggspec.serving.stops import TextStream
from pyggspec.tokenizer import Detokenizer


class Pieces:
    """The one method Detokenizer asks of a tokenizer: token id -> its bytes."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        return self.pieces[token]


def stream(pieces: list[bytes | str], stops=()) -> tuple[TextStream, list[tuple[str, str | None]]]:
    """Feed every piece (one token each) until a stop string matches, then finish if none
    did; returns the stream and what each call released."""
    raw = [p.encode() if isinstance(p, str) else p for p in pieces]
    ts = TextStream(Detokenizer(Pieces(raw)), stops)
    out = []
    for t in range(len(raw)):
        out.append(ts.add(t))
        if out[-1][1] is not None:
            return ts, out
    out.append(ts.finish())
    return ts, out


def texts(out) -> list[str]:
    return [o[0] for o in out]


def test_no_stop_strings_release_everything_at_once():
    ts, out = stream(["Hel", "lo", " world"])
    assert out == [("Hel", None), ("lo", None), (" world", None), ("", None)]
    assert ts.text == "Hello world"


def test_stop_string_in_one_token():
    ts, out = stream(["Hello", "STOP", "after"], stops=["STOP"])
    assert out == [("Hello", None), ("", "STOP")]
    assert ts.text == "Hello"


def test_partial_match_is_held_back_until_it_completes():
    ts, out = stream(["a", "<", "/", "s", ">", "b"], stops=["</s>"])
    assert out == [("a", None), ("", None), ("", None), ("", None), ("", "</s>")]
    assert ts.text == "a"


def test_partial_match_that_breaks_off_is_released():
    ts, out = stream(["a<", "/", "x", "y"], stops=["</s>"])
    assert texts(out) == ["a", "", "</x", "y", ""]
    assert out[-1][1] is None and ts.text == "a</xy"


def test_stop_string_starting_inside_a_token_and_spanning_three():
    ts, out = stream(["xx ST", "O", "P yy"], stops=["STOP"])
    assert out == [("xx ", None), ("", None), ("", "STOP")]
    assert ts.text == "xx "


def test_text_before_the_stop_in_the_same_token_is_released():
    ts, out = stream(["ab", "cSTOPd"], stops=["STOP"])
    assert out == [("ab", None), ("c", "STOP")]
    assert ts.text == "abc"


def test_earliest_stop_wins_and_the_longest_partial_is_held():
    _, out = stream(["xabc"], stops=["bc", "ab"])
    assert out == [("x", "ab")]
    # "abc" could still become "abcd" (3 chars held), though "c" alone also starts "cx"
    ts, out = stream(["zabc", "e"], stops=["abcd", "cx"])
    assert out[0] == ("z", None) and out[1] == ("abce", None)
    assert ts.text == "zabce"


def test_a_shorter_stop_completes_while_a_longer_one_is_pending():
    ts, out = stream(["a", "b", "c"], stops=["abc", "ab"])
    assert out == [("", None), ("", "ab")]
    assert ts.text == ""


def test_empty_stop_strings_are_ignored():
    ts, out = stream(["a", "b"], stops=["", "zz"])
    assert ts.stops == ("zz",)
    assert texts(out) == ["a", "b", ""]


def test_finish_releases_a_held_partial_match():
    ts, out = stream(["a", "</"], stops=["</s>"])
    assert out == [("a", None), ("", None), ("</", None)]
    assert ts.text == "a</"


def test_utf8_character_split_across_tokens_comes_out_whole():
    e = "é".encode()  # 2 bytes
    fox = "🦊".encode()  # 4 bytes
    ts, out = stream([b"caf", e[:1], e[1:] + b"!", fox[:2], fox[2:3], fox[3:]])
    assert texts(out) == ["caf", "", "é!", "", "", "🦊", ""]
    assert ts.text == "café!🦊" and "\ufffd" not in ts.text


def test_stop_string_with_a_character_split_across_tokens():
    e = "é".encode()
    ts, out = stream([b"caf", e[:1], e[1:] + b"!", b"more"], stops=["é!"])
    assert out == [("caf", None), ("", None), ("", "é!")]
    assert ts.text == "caf"


def test_an_incomplete_character_at_the_end_is_a_replacement_char():
    ts, out = stream([b"ok", "é".encode()[:1]])
    assert texts(out) == ["ok", "", "\ufffd"]
    assert ts.text == "ok\ufffd"


def test_without_a_detokenizer_nothing_is_released():
    ts = TextStream(None, ["x"])
    assert ts.add(5) == ("", None) and ts.finish() == ("", None) and ts.text == ""


def reference(pieces: list[bytes], stops: list[str]) -> tuple[str, str | None]:
    """What llama-server does, the slow way: after each token, search the whole text so far
    (complete characters only) for every stop string; the first token that completes one
    ends the text where the earliest complete stop string starts."""
    stops = [s for s in stops if s]
    raw = b""
    for p in pieces:
        raw += p
        text = raw.decode("utf-8", errors="ignore")  # valid UTF-8: drops only a cut tail
        found = [(i, n, s) for n, s in enumerate(stops) if (i := text.find(s)) >= 0]
        if found:
            i, _, s = min(found)
            return text[:i], s
    return raw.decode("utf-8", errors="replace"), None


@pytest.mark.parametrize("seed", range(4))
def test_random_streams_equal_the_slow_reference(seed):
    """Random UTF-8 text split at random byte offsets, random stop strings (some taken from
    the text): everything released so far is always a prefix of the final text, and the
    final text and the stop string reported are the reference's."""
    rng = random.Random(seed)
    alphabet = "ab<>/ é🦊"
    for _ in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(0, 3))]
        if text and rng.random() < 0.5:
            i = rng.randrange(len(text))
            stops.append(text[i:i + rng.randint(1, 4)])
        raw = text.encode()
        cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, rng.randint(0, 12)))) \
            if len(raw) > 1 else []
        pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)]) if b > a]
        want, want_stop = reference(pieces, stops)
        ts, out = stream(pieces, stops)
        released = ""
        for chunk, _ in out:
            released += chunk
            assert want.startswith(released), (text, stops, pieces, out)
        assert released == ts.text == want, (text, stops, pieces, out)
        assert out[-1][1] == want_stop, (text, stops, pieces, out)
