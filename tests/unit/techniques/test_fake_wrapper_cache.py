"""Predicted compiled regions in Inductor's caches (NOTE [ Predicted wrappers in Inductor's caches ]):
a prediction served from the cache in another process allocates exactly what the compiled one did,
and real compiles and predictions never load each other's wrappers (a real compile that loaded a
predicted wrapper would run kernels that do nothing)."""

import json
import os
import subprocess
import sys

import pytest

STAGE = r'''
import json, torch
from torch._dynamo.utils import counters
from memfit.memory.estimate import estimate
from memfit.plans import Plan
from memfit.techniques.compiled import compiled
from torch._subclasses.fake_tensor import FakeTensorMode

SPEC = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=64,attn_pdrop=0,resid_pdrop=0,embd_pdrop=0"
report = estimate(SPEC, Plan(compile="blocks"), batch_size=2, seq_len=32)
out = {"peak": report.peak_bytes, "fake_hits": counters["inductor"]["fxgraph_cache_hit"],
       "fake_misses": counters["inductor"]["fxgraph_cache_miss"]}
before = dict(counters["inductor"])  # a whole-model graph: its backward compiled lazily, in autograd's backward
out["full_peak"] = estimate(SPEC, Plan(compile="full"), batch_size=2, seq_len=32).peak_bytes
out["full_hits"] = counters["inductor"]["fxgraph_cache_hit"] - before.get("fxgraph_cache_hit", 0)
out["full_misses"] = counters["inductor"]["fxgraph_cache_miss"] - before.get("fxgraph_cache_miss", 0)

def region(x, w):
    h = torch.relu(x @ w) * 2.0
    return (h.sin() + h).sum(dim=0)

torch.manual_seed(0)
x, w = torch.randn(64, 32), torch.randn(32, 16)
step = compiled(region, name="test region")
with FakeTensorMode() as mode:
    step(mode.from_tensor(x), mode.from_tensor(w))  # the predicted wrapper of this graph, in the cache
hits = counters["inductor"]["fxgraph_cache_hit"]
real = step(x, w)
out["real_hits"] = counters["inductor"]["fxgraph_cache_hit"] - hits
out["real_equals_eager"] = bool(torch.allclose(real, region(x, w), rtol=1e-5, atol=1e-5))
print("RESULT" + json.dumps(out))
'''


def _stage(cache_dir) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    done = subprocess.run([sys.executable, "-c", STAGE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line.removeprefix("RESULT"))


@pytest.mark.slow  # (40-60 s on 2 cores: keeps the default suite under 10 minutes)
def test_a_cached_prediction_equals_the_compiled_one_and_real_compiles_stay_apart(tmp_path):
    first = _stage(tmp_path)
    assert first["fake_misses"] >= 1 and first["fake_hits"] == 0
    second = _stage(tmp_path)
    assert second["fake_hits"] >= 1 and second["fake_misses"] == 0  # served by the first process's entries
    assert second["peak"] == first["peak"]  # the cached wrapper allocates what the compiled one did
    # a backward graph compiled lazily, in autograd's backward, is a predicting compile too: kept, then served
    assert first["full_misses"] >= 2 and second["full_misses"] == 0 and second["full_hits"] == first["full_misses"]
    assert second["full_peak"] == first["full_peak"]
    # a real compile of the same graph in the same folder: never the predicted wrapper (no-op kernels)
    assert first["real_hits"] == 0 and first["real_equals_eager"]
    assert second["real_hits"] == 1 and second["real_equals_eager"]  # (the first process's real entry)
