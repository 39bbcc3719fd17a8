"""NOTE [ Searches in turns ] (memfit.planner.turns): chains of planner work run in threads that take
turns, one at a time, handing the turn on only where they wait for the trace workers; a job two of
them ask at once is traced once."""

import threading

import pytest

from memfit.planner.turns import Turns, current, in_turns
from tests.helpers import with_two_workers


class _FakePool:
    """Jobs that end, oldest first, each time someone polls."""

    def __init__(self) -> None:
        self.pending: list[dict] = []
        self.polls = 0

    def submit(self) -> dict:
        job = {"done": False}
        self.pending.append(job)
        return job

    def poll(self) -> None:
        self.polls += 1
        self.pending.pop(0)["done"] = True


def test_a_chain_that_waits_hands_its_turn_to_another_and_only_one_runs_at_a_time():
    pool, log, running = _FakePool(), [], []

    def chain(name: str, steps: int):
        def run():
            for step in range(steps):
                assert not running, (name, running)  # (one thread at a time)
                running.append(name)
                log.append(f"{name}{step}")
                job = pool.submit()
                running.remove(name)
                current().wait(lambda job=job: job["done"], pool.poll)
            return name
        return run

    assert in_turns([chain("a", 3), chain("b", 2)]) == ["a", "b"]
    # a waits for its first job: b hands out its own before a's ends; one poll ends each job
    assert log[:2] == ["a0", "b0"], log
    assert sorted(log) == ["a0", "a1", "a2", "b0", "b1"] and pool.polls == 5 and not pool.pending
    assert current() is None  # (the turns end with the call)


def test_apart_they_run_one_after_another():
    log = []
    in_turns([lambda: log.append("a"), lambda: log.append("b")], together=False)
    assert log == ["a", "b"]


def test_an_error_in_one_chain_is_raised_and_the_others_stop():
    pool, ended = _FakePool(), []

    def fails():
        raise ValueError("plan error")

    def waits():
        job = pool.submit()
        current().wait(lambda: job["done"], pool.poll)
        ended.append("waits")

    with pytest.raises(ValueError, match="plan error"):
        in_turns([fails, waits])
    assert ended == []
    assert not [t for t in threading.enumerate() if t.name.startswith("memfit-turn")]  # (every thread ended)


def test_turns_nest_a_chain_gathers_its_own():
    pool, log = _FakePool(), []

    def leaf(name):
        def run():
            job = pool.submit()
            log.append(f"asked {name}")
            current().wait(lambda: job["done"], pool.poll)
            log.append(f"got {name}")
        return run

    def group(names):
        return lambda: in_turns([leaf(n) for n in names])

    in_turns([group(["a", "b"]), group(["c"])])
    assert sorted(log[:3]) == ["asked a", "asked b", "asked c"], log  # every leaf asks before any waits out
    assert sorted(log[3:]) == ["got a", "got b", "got c"]


def test_waiting_for_nothing_any_thread_polls_is_an_error_not_a_hang():
    turns = Turns()
    done = threading.Event()
    with pytest.raises(RuntimeError, match="none for the trace workers"):
        turns.wait(done.is_set)

    def stuck():
        current().wait(lambda: False)  # (no trace to wait for: no thread will ever make it go on)

    with pytest.raises(RuntimeError, match="none for the trace workers"):
        in_turns([stuck, stuck])


POOL = """
import os, sys, time
from memfit.planner.turns import in_turns
from memfit.planner.workers import SharedWorkers
log = sys.argv[1]
def traced(name):
    start = time.time()
    time.sleep(0.4)
    end = time.time()
    with open(log, "a") as f:
        f.write(f"{name} {start} {end}\\n")
    return name, os.getpid()
pool = SharedWorkers()
lane = pool.lane(traced)
lane.map(["warm"])                                     # (the pool forks)
answers = {}
def chain(name):
    def run():
        answers[name] = lane.map([name]) + lane.map(["shared"])
    return run
in_turns([chain("a"), chain("b")])
assert [n for n, _ in answers["a"]] == ["a", "shared"] and [n for n, _ in answers["b"]] == ["b", "shared"]
ran = {}
for line in open(log):
    name, start, end = line.split()
    ran.setdefault(name, []).append((float(start), float(end)))
(a,), (b,) = ran["a"], ran["b"]
assert b[0] < a[1], ran                                 # b's job started while a's map waited for a's
assert len(ran["shared"]) == 1, ran                    # asked by both chains at once: traced once
pool.close()
print("ok")
"""


def test_chains_in_turns_share_the_pool_and_a_job_in_flight(tmp_path):
    assert with_two_workers(POOL, str(tmp_path / "log")) == "ok"


LINE = """
import warnings
warnings.filterwarnings("ignore")
from memfit.devices import get_device
from memfit.memory.budget import Budget
from memfit.planner.methods import parse_methods
from memfit.planner.recipes import recipes
from memfit.planner.space import model_facts
from memfit.planner.traces import TraceBook
from memfit.planner.turns import in_turns
from memfit.plans import Plan
from memfit.target import Target
from memfit.workloads import load_workload
workload = load_workload("llama:num_hidden_layers=6,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
                         "num_key_value_heads=2,vocab_size=512", seq_len=256)
card = get_device("rtx4090")
facts = model_facts(workload)
plan = recipes(parse_methods("lora")[0], facts, card)[-1].plan
book = TraceBook(Target(workload, Plan(), 1, card), facts, Budget.of_device(card))
book.at_batch(plan, 2), book.at_batch(plan, 3)         # a line through two batches, not yet decided
before = book.traces
got = in_turns([lambda: book.at_batch(plan, 5), lambda: book.at_batch(plan, 7)])
assert book.workers.count == 2
print(book.traces - before, dict(book.lines()))
book.close()
"""


def test_a_search_in_turns_waits_for_the_batch_that_decides_a_line_and_draws_on_it():
    """NOTE [ Searches in turns ]: two searches ask a plan at 5 and 7 samples while its line (through 2 and 3)
    is undecided; the second waits for the first's batch, which decides the line, and draws 7 on it: one
    shallow pair, as when they are asked one after the other."""
    assert with_two_workers(LINE, timeout=300).startswith("2 {'trusted': 1, 'broken': 0}")


EDGES = """
import os, signal, sys, threading, time, warnings
from memfit.planner.turns import current, in_turns
from memfit.planner.workers import SharedWorkers
log = sys.argv[1]
def traced(name):
    time.sleep(2 if name == "slow" else 0.2)
    with open(log, "a") as f:
        f.write(name + "\\n")
    return name
def ran():
    return open(log).read().split()
guard = threading.Timer(60, lambda: (print("HANG", flush=True), os._exit(3)))
guard.daemon = True
guard.start()
pool = SharedWorkers()
lane = pool.lane(traced, affinity=lambda job: "K" if job.startswith("k") else None)
lane.map(["warm"])

# a deeper trace after its shallower one, and a compile's key busy while the other process idles: a wait,
# not a spin that never polls the workers
pair = lambda n: (lambda: lane.map([n + "-shallow", n + "-deep"], after={n + "-deep": n + "-shallow"}))
assert in_turns([pair("a"), pair("b")]) == [["a-shallow", "a-deep"], ["b-shallow", "b-deep"]]
assert in_turns([lambda: lane.map(["k1"]), lambda: lane.map(["k2"])]) == [["k1"], ["k2"]]

# a job one search waits to hand out while another hands it out, or queues it behind: traced once
open(log, "w").close()
out = in_turns([lambda: lane.map(["a1", "a2", "shared"]), lambda: lane.map(["b1", "b2", "shared"])])
assert ran().count("shared") == 1 and out[0][2] == out[1][2] == "shared", ran()
open(log, "w").close()
in_turns([lambda: lane.map(["x"]), lambda: lane.map(["y"], behind=["x"])])
time.sleep(0.5); pool.pump()
assert ran().count("x") == 1 and not pool._background, (ran(), pool._background)

# a search's warning filters are its own across the turns of the others
def quiet(steps):
    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for i in range(steps):
                lane.map([f"q{steps}-{i}"])
                warnings.warn("inside: an error")
    return run
try:
    in_turns([quiet(1), quiet(3)])
    raise SystemExit("a warning inside a search was not its own filters'")
except UserWarning:
    pass
warnings.warn("outside: only a warning")  # (the filters as before, once the turns end)

# a worker that dies while another search takes the answers: the search waiting for it goes on, here
def dies():
    pid = pool._pool._procs[0].pid if pool._pool else None
    if pid:
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.3)
    lane.start(["bg"])
    lane.pump()
assert in_turns([lambda: lane.map(["slow"]), dies]) == [["slow"], None]
pool.close()
guard.cancel()
print("ok")
"""


def test_the_edges_of_turns_on_a_real_pool(tmp_path):
    """Found in review of NOTE [ Searches in turns ]: a search whose job waits for another (a deeper trace, a
    compile's process) waits for an answer rather than spinning; a job two searches ask, or queue, is traced
    once; each search keeps its own warning filters; a dead worker's answer reaches the search waiting."""
    assert with_two_workers(EDGES, str(tmp_path / "log"), flags=("-W", "default")) == "ok"


def test_an_error_in_one_chain_stops_the_others_at_their_next_wait():
    pool, log = _FakePool(), []

    def chain(name):
        def run():
            for step in range(3):
                log.append(f"{name}{step}")
                job = pool.submit()
                if name == "a" and step == 1:
                    raise KeyboardInterrupt  # (or a bug: the table cannot be finished)
                current().wait(lambda job=job: job["done"], pool.poll)
        return run

    with pytest.raises(KeyboardInterrupt):
        in_turns([chain("a"), chain("b"), chain("c")])
    assert "a2" not in log and "b2" not in log and "c2" not in log, log  # (no chain went on past the interrupt)
    assert not [t for t in threading.enumerate() if t.name.startswith("memfit-turn")]  # (every thread ended)
