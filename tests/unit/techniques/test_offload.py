"""Offload and EMA placement: exact results, device-side saving by per-device accounting."""

import warnings

import pytest
import torch

from helpers import GPT2_DROPOUT, assert_same_training, measured, run_steps
from memfit.plans import Plan
from memfit.techniques.placement import HostPlacement

SPEC = "gpt2:n_layer=2,n_embd=128,n_head=4,vocab_size=1000,n_positions=128"


def test_placement_round_trips_exactly_and_reports_host_copies():
    seen = []

    class Obs:
        def host(self, t):
            seen.append(t)
    pl = HostPlacement()
    pl.observer = Obs()
    for t in (torch.randn(5, 7), torch.randn(3, 4).t(), torch.randint(0, 9, (4,)), torch.randn(6).bfloat16()):
        back = pl.to_device(pl.to_host(t), t.device)
        assert torch.equal(back, t) and back.dtype == t.dtype and back.untyped_storage()._cdata != t.untyped_storage()._cdata
    assert len(seen) == 4


def test_offloaded_activations_train_exactly_the_same_with_dropout():
    assert_same_training(run_steps(GPT2_DROPOUT, Plan()), run_steps(GPT2_DROPOUT, Plan(offload=["activations"])))


def test_device_side_savings():
    base = measured(SPEC, Plan())
    states = measured(SPEC, Plan(offload=["optimizer_states"]))
    acts = measured(SPEC, Plan(offload=["activations"]))
    for r in (states, acts):
        assert abs(r.error_percent) <= 1.0  # device + host together vs the profiler
    # optimizer states: on the host (memfit.techniques.offload_optimizer; more in test_offload_optimizer.py)
    assert states.predicted.host_peak_bytes >= base.predicted.breakdown["optimizer_states"]
    assert states.predicted.peak_bytes < base.predicted.peak_bytes
    # activations: the device keeps only what is too small to offload
    assert acts.predicted.breakdown["activations"] < 0.3 * base.predicted.breakdown["activations"]
    assert acts.predicted.peak_bytes < base.predicted.peak_bytes
    assert acts.predicted.host_peak_bytes > 0.5 * base.predicted.breakdown["activations"]


def test_ema_shadow_follows_the_weights_and_lives_where_asked():
    losses, params, step = run_steps(GPT2_DROPOUT, Plan(ema={"decay": 0.9, "device": "cpu", "every": 1}), steps=4)
    # reference: shadow initialised from the weights after step 1, then decayed toward each later step
    for name, s in step.ema.state_dict()["shadow"].items():  # (after the last average: state_dict waits)
        ref = params[0][name].clone()
        for p in params[1:]:
            ref = 0.9 * ref + 0.1 * p[name]
        torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-7)
    # EMA never changes training itself
    assert_same_training(run_steps(GPT2_DROPOUT, Plan(), steps=4), (losses, params, None))
    on_host = measured(SPEC, Plan(ema={"decay": 0.99, "device": "cpu"}))
    on_device = measured(SPEC, Plan(ema={"decay": 0.99, "device": "device"}))
    param_bytes = on_host.predicted.breakdown["parameters"]
    assert on_host.predicted.host_peak_bytes == 2 * param_bytes  # the shadow, and the copies it averages
    assert on_device.predicted.peak_bytes - on_host.predicted.peak_bytes == param_bytes
    assert abs(on_host.error_percent) <= 1.0 and abs(on_device.error_percent) <= 1.0


def test_ema_loading_a_shadow_of_fewer_parameters_says_which_start_afresh():
    _, params, step = run_steps(GPT2_DROPOUT, Plan(ema={"decay": 0.9, "device": "device", "every": 1}), steps=2)
    saved = step.ema.state_dict()
    names = sorted(saved["shadow"])
    partial = {"updates": saved["updates"], "shadow": {n: saved["shadow"][n].clone() + 1 for n in names[1:]}}
    with pytest.warns(UserWarning, match=rf"no average of 1 trained parameter\(s\) \({names[0]}\)"):
        step.ema.load_state_dict(partial)
    loaded = step.ema.state_dict()["shadow"]
    assert all(torch.equal(loaded[n], partial["shadow"][n]) for n in names[1:])
    torch.testing.assert_close(loaded[names[0]], params[-1][names[0]].float())  # from the current weights
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step.ema.load_state_dict(saved)  # a whole shadow says nothing
