"""NOTE [ Methods planned side by side ]: searches in forked processes, each result back in order,
progress relayed to a line per search, a user error raised here, a search whose process died run
again here, and the searches in turn where processes cannot be forked."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from memfit.errors import UserError
from memfit.planner import side_by_side
from memfit.planner.side_by_side import plan_side_by_side
from memfit.planner.workers import worker_count

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


@pytest.mark.slow  # (about 30 s on 2 cores: keeps the default suite under 10 minutes)
def test_a_search_killed_while_it_reports_leaves_the_others_to_come_back():
    """NOTE [ A pipe per search ]: a search killed while it writes its progress (the kernel's OOM
    killer) must not stop the others: with one queue for all, it held the queue's lock forever and
    the other search, then the command, waited without end (100 rounds here hung within seconds).
    Run in a process of its own, so that a hang fails the test instead of stopping the suite."""
    script = _two_searches("""
        def search(label, die=False, progress=None, alongside=True):
            for i in range(300):
                progress.walk(i, 60, 3)
            if die and os.getpid() != PARENT:
                os._exit(1)
            return label, os.getpid() == PARENT
    """, rounds=100)
    assert "all back" in _run_alone(script)


@pytest.mark.parametrize("cut", [False, True], ids=["idle", "in-the-middle-of-a-message"])
def test_a_search_killed_with_trace_workers_of_its_own_leaves_no_one_waiting(cut):
    """NOTE [ A worker outlives no one ] (memfit.planner.processes): a search killed while its own
    trace workers idle. Those workers held the pipes and the process sentinel of the killed search
    and waited for jobs for ever; the command waited for them (a ``memfit plan --methods`` whose
    LoRA search was killed never ended). Now the killed search runs again here and its workers end.
    ``cut``: killed in the middle of a message (its result, the longest): this process reads the rest
    until the workers, which hold the pipe too, have ended, and then takes the message as cut."""
    script = _two_searches("""
        def search(label, die=False, progress=None, alongside=True):
            progress.walk(1, 60, 3)
            if die and os.getpid() != PARENT:
                workers = ForkedProcesses(2, abs, os.getpid)
                with open(os.environ["PIDS"], "w") as f:
                    f.write(" ".join(str(w) for w in workers.firsts))
                if os.environ["CUT"]:  # a message's length, and only the start of it
                    progress.conn._send(struct.pack("!i", 10_000_000) + b"the start")
                os._exit(1)
            return label, os.getpid() == PARENT
    """, rounds=1)
    import tempfile
    with tempfile.NamedTemporaryFile("r") as pids:
        assert "all back" in _run_alone(script, PIDS=pids.name, CUT="1" if cut else "")
        workers = [int(p) for p in pids.read().split()]
    assert len(workers) == 2
    for _ in range(100):  # (they end as soon as they see their parent gone; a zombie has ended too)
        if not any(_running(pid) for pid in workers):
            break
        time.sleep(0.1)
    assert not any(_running(pid) for pid in workers), "the killed search's workers are still waiting"


def _two_searches(search: str, rounds: int) -> str:
    """A script: ``rounds`` times, searches a and b side by side with ``search`` (b dies in its
    process and runs again here); each round's results checked, then "all back" printed."""
    return textwrap.dedent("""
        import os, struct
        from memfit.planner import side_by_side
        from memfit.planner.processes import ForkedProcesses
        PARENT = os.getpid()

        class Line:
            stage = walk = done = lambda self, *a: None
    """) + textwrap.dedent(search) + textwrap.dedent(f"""
        for _ in range({rounds}):
            got = side_by_side._forked([("a", {{"label": "a"}}), ("b", {{"label": "b", "die": True}})],
                                       [Line(), Line()], search, None, 0)
            assert [r for r, _ in got] == [("a", False), ("b", True)], got
        print("all back")
    """)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _run_alone(script: str, **env) -> str:
    """Run ``script`` in a Python process (and session) of its own: its stdout. A hang fails the test
    (after 60 s, with every process it started killed) instead of stopping the suite."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, **env})
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # (its searches too)
        proc.communicate()
        pytest.fail("the searches did not come back in 60 s: one waits for a search that was killed")
    assert proc.returncode == 0, err[-2000:]
    return out


def test_traces_of_ones_own_run_in_a_process_of_their_own_and_leave_workers_forkable():
    """NOTE [ Traces of one's own in a process of their own ]: a fake step (with its backward) run through
    ``in_own_process`` comes back, and the process can still fork trace workers after it; run here, it
    could not. A fresh interpreter: this test session's own backward passes would hide it."""
    code = textwrap.dedent("""
        from memfit.memory.estimate import estimate_target
        from memfit.planner.side_by_side import can_fork_searches, in_own_process
        from memfit.target import Target
        target = Target.resolve("gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64", None, 2, "rtx4090", seq_len=8)
        peak = in_own_process(lambda: estimate_target(target).peak_bytes)
        forkable = can_fork_searches()
        here = estimate_target(target).peak_bytes
        print(peak == here, forkable, can_fork_searches())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    cores = worker_count() >= 2  # (with one core no search forks: all runs here)
    assert out.stdout.split() == ["True", str(cores), "False"], out.stderr[-2000:]


def test_a_user_error_in_a_process_of_its_own_is_raised_here():
    def refuse():
        raise UserError("no value fits")
    with pytest.raises(UserError, match="no value fits"):
        side_by_side.in_own_process(refuse)
    assert side_by_side.in_own_process(lambda: os.getpid()) != PARENT or not side_by_side.can_fork_searches()
