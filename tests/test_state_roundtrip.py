"""Every resumable object checkpointed after every step, resumed from each checkpoint, compared.

The harness and the cases are in tests/state_harness.py (add new resumable objects there).
"""
from __future__ import annotations

import pytest
from state_harness import CASES, TORCH_CASES, Resumable, assert_resumes_at_every_step


@pytest.mark.parametrize("name", sorted(CASES))
def test_resumes_exactly_from_a_checkpoint_after_every_step(name, tmp_path):
    if name in TORCH_CASES:
        pytest.importorskip("torch")
    assert_resumes_at_every_step(CASES[name](tmp_path))


# ------------------------------------------------------------------ the harness itself can fail


class Counter:
    """A toy resumable: counts up; `history` is the outputs so far."""

    def __init__(self):
        self.history: list[int] = []

    def __iter__(self):
        while True:
            self.history.append(len(self.history))
            yield self.history[-1]


def _counter_case(save, load) -> Resumable:
    return Resumable("counter", Counter, iter, save=save, load=load, steps=6)


def test_a_correct_toy_resumable_passes():
    assert_resumes_at_every_step(_counter_case(lambda c, _s: list(c.history),
                                               lambda c, h: c.history.extend(h)))


def test_a_state_that_aliases_live_data_is_caught():
    # the state is the live list: later steps change every earlier checkpoint
    with pytest.raises(AssertionError, match="resumed after step 0"):
        assert_resumes_at_every_step(_counter_case(lambda c, _s: c.history, lambda c, h: c.history.extend(h)))


def test_a_resume_that_is_off_by_one_at_one_step_is_caught():
    def load(c, history):
        c.history.extend(history if len(history) != 4 else history[:-1])
    with pytest.raises(AssertionError, match="resumed after step 4"):
        assert_resumes_at_every_step(_counter_case(lambda c, _s: list(c.history), load))


def test_a_save_that_disturbs_the_stream_is_caught():
    def save(c, _step):
        c.history.append(-1)  # taking the state advances the object
        return list(c.history)
    with pytest.raises(AssertionError, match="the checkpointed run"):
        assert_resumes_at_every_step(_counter_case(save, lambda c, h: c.history.extend(h)))
