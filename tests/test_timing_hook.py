"""The stage hook (``mcfn.core.timing_hook``): a plain call by default, the recorder's call while one is installed."""

import pytest

from mcfn.core.timing_hook import recording, stage


@stage("double")
def double(x: int) -> int:
    return 2 * x


def test_a_stage_is_a_plain_call_without_a_recorder():
    assert double(3) == 6


def test_a_recorder_sees_each_call_and_its_answer_is_the_result():
    calls = []

    def recorder(name, fn, *args):
        calls.append((name, fn.__name__, args))
        return fn(*args) + 1  # a recorder that changed the answer would show here

    with recording(recorder):
        assert double(3) == 7
    assert calls == [("double", "double", (3,))]
    assert double(3) == 6, "the recorder is gone after the block"


def test_recorders_do_not_nest_and_a_failure_uninstalls_the_recorder():
    with pytest.raises(ZeroDivisionError), recording(lambda name, fn, *a: fn(*a)):
        with pytest.raises(RuntimeError, match="already installed"), recording(lambda *a: None):
            pass
        raise ZeroDivisionError
    assert double(1) == 2
