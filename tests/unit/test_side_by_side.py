"""NOTE [ Methods planned side by side ]: searches in forked processes, each result back in order,
progress relayed to a line per search, a user error raised here, a search whose process died run
again here, and the searches in turn where processes cannot be forked."""

import os

import pytest

from memfit.errors import UserError
from memfit.planner import side_by_side
from memfit.planner.side_by_side import plan_side_by_side

PARENT = os.getpid()


def _search(label, die=False, error=None, progress=None, alongside=True):
    """A stand-in for memfit.planner.search.plan."""
    progress.stage("timing techniques")
    progress.walk(1, 60, 3)
    if die and os.getpid() != PARENT:
        os._exit(1)
    if error:
        raise UserError(error)
    return {"label": label, "pid": os.getpid(), "alongside": alongside, "nice": os.nice(0)}


class _Line:
    def __init__(self):
        self.seen = []

    def stage(self, text):
        self.seen.append(("stage", text))

    def walk(self, *args):
        self.seen.append(("walk", args))

    def done(self, text):
        self.seen.append(("done", text))


def _forked(searches, longest=0):
    lines = [_Line() for _ in searches]
    results = side_by_side._forked(searches, lines, _search, lambda r: r["label"].upper(), longest)
    return results, lines


def test_searches_run_in_processes_of_their_own_and_come_back_in_order():
    (a, b), lines = _forked([("a", {"label": "a"}), ("b", {"label": "b"})], longest=1)
    assert [r["label"] for r, _ in (a, b)] == ["a", "b"] and [x for _, x in (a, b)] == ["A", "B"]
    assert a[0]["pid"] != PARENT and b[0]["pid"] != PARENT and a[0]["pid"] != b[0]["pid"]
    assert not a[0]["alongside"] and not b[0]["alongside"]  # (the other searches use the cores)
    assert a[0]["nice"] == os.nice(0) + side_by_side.LOWER and b[0]["nice"] == os.nice(0)  # the longest keeps its priority
    for line in lines:
        assert ("stage", "timing techniques") in line.seen and ("walk", (1, 60, 3)) in line.seen


def test_a_search_whose_process_died_runs_again_here_and_a_user_error_is_raised_here():
    (a, b), _ = _forked([("a", {"label": "a"}), ("b", {"label": "b", "die": True})])
    assert a[0]["pid"] != PARENT and b[0]["pid"] == PARENT and b[1] == "B"
    with pytest.raises(UserError, match="no plan fits"):
        _forked([("a", {"label": "a"}), ("b", {"label": "b", "error": "no plan fits"})])


def test_the_searches_run_in_turn_where_processes_cannot_be_forked(monkeypatch):
    monkeypatch.setattr(side_by_side, "can_fork_searches", lambda: False)
    results = plan_side_by_side([("a", {"label": "a"}), ("b", {"label": "b"})], plan=_search)
    assert [r["label"] for r, _ in results] == ["a", "b"] and all(r["pid"] == PARENT for r, _ in results)
