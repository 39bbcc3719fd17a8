"""A log call inside a region memfit compiles (NOTE [ A log call inside a compiled region ] in
memfit.techniques.compiled): captured whole, with Dynamo's config as the user left it outside memfit's
regions, and no failed write of that config into a compile's metrics on a torch that cannot write it."""

import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")  # its Logger.warning_once is what models call
from transformers.utils import logging as hf_logging  # noqa: E402

from memfit.techniques import compiled as compiled_mod  # noqa: E402

LOG = hf_logging.get_logger("memfit.tests.compile_logging")


def _logs_once(x):
    LOG.warning_once("a model's forward logs once")
    return torch.nn.functional.gelu(x) * 2.0


def _scales(x):
    return torch.sin(x) + 1.0


def test_a_region_that_logs_once_is_captured_whole_and_the_users_config_is_left_as_it_was():
    before = set(torch._dynamo.config.ignore_logging_functions)
    region = compiled_mod.compiled(_logs_once, name="logging block")
    x = torch.randn(4, 8)
    torch.testing.assert_close(region(x), torch.nn.functional.gelu(x) * 2.0)  # fullgraph: a break would raise
    assert logging.Logger.warning_once not in torch._dynamo.config.ignore_logging_functions
    assert set(torch._dynamo.config.ignore_logging_functions) == before


def test_on_a_torch_that_cannot_write_a_function_into_its_metrics_no_compile_fails_to_write_them(monkeypatch):
    """torch 2.11's writer, which leaves the set in (2.14 leaves it out): each compile of a region used to
    fail to write it, and Dynamo logged the failure's traceback, whose frames a kept log record held."""
    failed = []

    def writer_of_torch_2_11():
        config = {"ignore_logging_functions": sorted(torch._dynamo.config.ignore_logging_functions, key=id),
                  "recompile_limit": torch._dynamo.config.recompile_limit}
        try:
            return json.dumps(config, sort_keys=True)
        except TypeError:
            failed.append(config)
            raise

    monkeypatch.setattr(torch._dynamo.utils, "_get_dynamo_config_for_logging", writer_of_torch_2_11)
    compiled_mod._metrics_write_the_set.cache_clear()
    try:
        assert not compiled_mod._metrics_write_the_set()  # (the probe's own write fails, as it should)
        failed.clear()
        region = compiled_mod.compiled(_scales, name="block")
        x = torch.randn(4, 8)
        torch.testing.assert_close(region(x), torch.sin(x) + 1.0)
    finally:
        monkeypatch.undo()
        compiled_mod._metrics_write_the_set.cache_clear()
    assert not failed
