"""NOTE [ One pool for many books ] (memfit.planner.workers): several job functions share one pool of
forked processes, each through its lane, and the background of any lane is handed out by ``pump``
while the planner computes, without a ``map`` waiting."""

from tests.helpers import with_two_workers

SHARED = """
import os, sys, time
from memfit.planner.workers import Lane, SharedWorkers, Workers
log = sys.argv[1]
def traced(kind):
    def fn(name):
        start = time.time()
        time.sleep(0.3)
        with open(log, "a") as f:
            f.write(f"{kind}:{name}\\n")
        return kind, name, os.getpid(), start
    return fn
pool = SharedWorkers()
a, b = pool.lane(traced("a")), pool.lane(traced("b"))
assert isinstance(a, Lane) and a.count == b.count == 2
out_a = a.map(["x", "y"])                       # the pool forks here, with both lanes' functions
assert [(k, n) for k, n, *_ in out_a] == [("a", "x"), ("a", "y")] and all(p != os.getpid() for *_, p, _ in out_a)
b.start(["q1", "q2", "q3"])                     # b's first jobs, queued in the background
a.start(["later"])
a.cancel()                                      # a lane drops its own queued jobs only
pool.pump()                                     # handed to the idle processes without waiting
time.sleep(0.8)                                 # (the planner computes)
pool.pump()
asked = time.time()
out_b = b.map(["q1", "q2", "q3", "fresh"])      # the background's results are taken, not traced again
assert [(k, n) for k, n, *_ in out_b] == [("b", "q1"), ("b", "q2"), ("b", "q3"), ("b", "fresh")]
assert {p for *_, p, _ in out_a} == {p for *_, p, _ in out_b}, (out_a, out_b)   # one pool: the same processes
assert out_b[0][3] < asked and out_b[1][3] < asked, (out_b, asked)   # they started before the map asked
ran = open(log).read().split()
assert ran.count("b:q1") == 1 and "a:later" not in ran, ran
late = pool.lane(traced("c"))                   # after the fork: processes of its own
assert isinstance(late, Workers) and [n for _, n, *_ in late.map(["z"])] == ["z"]
late.close()
pool.close()
print("ok")
"""


def test_lanes_share_one_pool_and_the_background_runs_while_the_planner_computes(tmp_path):
    assert with_two_workers(SHARED, str(tmp_path / "log")) == "ok"
