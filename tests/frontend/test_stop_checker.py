from __future__ import annotations

import pytest

from tokenmill.frontend.stop_checker import StopChecker, StopMatch
from tokenmill.sampling_params import SamplingParams


def feed(checker: StopChecker, deltas: list[str]) -> tuple[str, StopMatch | None, list[str]]:
    """Streams deltas like the output processor; returns final text, the match, what was shown."""
    text, shown, sent = "", [], 0
    for delta in deltas:
        text += delta
        match = checker.find(text, len(delta))
        if match is not None:
            text = text[:match.keep]
            shown.append(text[sent:])
            return text, match, shown
        safe = checker.safe_length(text)
        assert safe >= sent
        shown.append(text[sent:safe])
        sent = safe
    shown.append(text[sent:])
    return text, None, shown


def test_spanning_deltas():
    text, match, shown = feed(StopChecker(["STOP"]), ["abc S", "T", "OP", " more"])
    assert match == StopMatch("STOP", 4) and text == "abc "
    assert shown == ["abc ", "", ""]


def test_at_the_very_start():
    assert feed(StopChecker(["ab"]), ["a", "bc"])[:2] == ("", StopMatch("ab", 0))


def test_include_stop_string():
    text, match, shown = feed(StopChecker(["STOP"], include_stop_str_in_output=True), ["x ST", "OP y z"])
    assert (text, match) == ("x STOP", StopMatch("STOP", 6))
    assert shown == ["x ST", "OP"]  # nothing held back: the stop string is shown anyway


def test_earliest_match_wins_not_list_order():
    text, match, _ = feed(StopChecker(["world", "lo"]), ["hello world"])
    assert (text, match) == ("hel", StopMatch("lo", 3))


def test_only_the_new_window_is_searched():
    checker = StopChecker(["ab"])
    assert checker.find("ab xyz", 3) is None  # an old match is not re-reported
    assert checker.find("ab xyz", 0) is None
    assert checker.find("xxab", 1) == StopMatch("ab", 2)


def test_partial_prefix_held_back_then_released():
    checker = StopChecker(["</end>", "##"])
    assert checker.safe_length("text </en") == 5
    assert checker.safe_length("text #") == 5
    assert checker.safe_length("text </x") == 8
    text, match, shown = feed(checker, ["a <", "/e", "x b #", "c"])
    assert match is None and "".join(shown) == text == "a </ex b #c"
    assert shown == ["a ", "", "</ex b ", "#c", ""]


def test_stop_strings_are_checked_by_the_params():
    """The checker trusts its stop strings: SamplingParams.validate refuses what would break it."""
    with pytest.raises(ValueError, match="^stop must be a list of non-empty strings"):
        SamplingParams(stop=["ok", ""]).validate()
    with pytest.raises(ValueError, match="^stop strings are only supported when detokenize is True"):
        SamplingParams(stop=["ok"], detokenize=False).validate()
    SamplingParams(stop=[], detokenize=False).validate()  # no stop strings: nothing to match
    SamplingParams(detokenize=False).validate()
