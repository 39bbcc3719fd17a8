"""NOTE [ A hub that cannot be reached ]: without HF_HUB_OFFLINE, on a machine that cannot reach the hub, a
process tries one connection and then reads the cache alone (huggingface_hub retried each lookup five times, 23
s); where the connection opens but lookups fail, one lookup's tries at most; what is cached answers as before.

These run huggingface_hub's own ``hf_hub_download`` against a cache laid out as it lays it out, with the name
service failing (counted) and its backoff's sleep skipped."""

import socket

import pytest
from huggingface_hub import constants
from huggingface_hub.utils import _detect_agent, _http

from memfit.errors import UserError
from memfit.workloads import hub
from memfit.workloads.hub import hub_config_folder

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")

FLUX = {"_class_name": "FluxTransformer2DModel", "attention_head_dim": 16, "num_attention_heads": 2, "num_layers": 1,
        "num_single_layers": 1, "in_channels": 16, "joint_attention_dim": 32, "pooled_projection_dim": 16,
        "axes_dims_rope": [4, 6, 6], "guidance_embeds": True}
PIPELINE = {"model_index.json": {"_class_name": "FluxPipeline", "transformer": ["diffusers", FLUX["_class_name"]],
                                 "text_encoder": ["transformers", "CLIPTextModel"],
                                 "text_encoder_2": ["transformers", "T5EncoderModel"], "vae": ["diffusers", "AutoencoderKL"]},
            "transformer/config.json": FLUX}
"""A pipeline as memfit's own message advises caching it: model_index.json and the denoiser's config (its text
encoders' configs, optional, not cached)."""


def tries_of_one_lookup(asked: list) -> int:
    """The name lookups of one ``hf_hub_download`` of a file not cached (its tries and retries)."""
    from huggingface_hub import errors, hf_hub_download
    before = len(asked)
    with pytest.raises(errors.LocalEntryNotFoundError):
        hf_hub_download("acme/elsewhere", "config.json")
    return len(asked) - before


@pytest.fixture
def unreachable(hub_cache, monkeypatch):
    """The cache, with HF_HUB_OFFLINE unset and every name lookup failing; returns the names asked for."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for v in PROXY_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(hub, "_REACHABLE", {})
    monkeypatch.setattr(_http.time, "sleep", lambda s: None)
    # (huggingface_hub's user agent asks the hub for a registry once a process, one try, whatever memfit does)
    monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)
    asked = []

    def no_name_service(host, *args, **kwargs):
        asked.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_name_service)
    hub_cache.asked = asked
    return hub_cache


def test_a_cached_pipeline_asks_no_name_service_past_the_first_look(unreachable):
    """The host name does not resolve: the one look at it, and every lookup from the cache (it was 3 lookups of
    six tries each: config.json, then both text encoders' configs)."""
    unreachable("acme/fluxlike", None, files=PIPELINE)
    folder = hub_config_folder("acme/fluxlike")
    assert folder.name == "transformer" and (folder / "config.json").exists()
    assert unreachable.asked == ["huggingface.co"]


def test_a_firewall_costs_one_connection_tried(unreachable, monkeypatch):
    """The name resolves, and the packets are dropped: the one connection tried times out (at ``PROBE_SECONDS``),
    then every lookup reads the cache (before, huggingface_hub's tries and retries of three lookups)."""
    tried = []

    def dropped(address, timeout=None, *args, **kwargs):
        tried.append((address, timeout))
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", dropped)
    unreachable("acme/fluxlike", None, files=PIPELINE)
    assert hub_config_folder("acme/fluxlike").name == "transformer"
    with pytest.raises(UserError, match="not in the Hugging Face cache .* and the hub cannot be reached"):
        hub_config_folder("acme/not-cached")
    assert tried == [(("huggingface.co", 443), hub.PROBE_SECONDS)]


def test_where_a_connection_opens_but_the_hub_does_not_answer_one_lookup_tries(unreachable, monkeypatch):
    """The first lookup not cached tries (and retries), the others read the cache only."""
    monkeypatch.setattr(hub, "_connects", lambda endpoint: True)
    unreachable("acme/fluxlike", None, files=PIPELINE)
    one = tries_of_one_lookup(unreachable.asked)
    assert one > 1 and hub_config_folder("acme/fluxlike").name == "transformer"
    assert len(unreachable.asked) == 2 * one  # (config.json's, then the cache; before, the two text encoders' configs tried too)
    assert hub_config_folder("acme/fluxlike").name == "transformer" and len(unreachable.asked) == 2 * one


def test_an_id_not_cached_is_one_line_at_once(unreachable):
    with pytest.raises(UserError, match="config.json is not in the Hugging Face cache .* and the hub cannot be reached"):
        hub_config_folder("acme/not-cached")
    assert unreachable.asked == ["huggingface.co"]


def test_a_proxy_is_asked_as_the_lookups_would_ask_it(unreachable, monkeypatch):
    """With a proxy set, the one request goes through it, as huggingface_hub's lookups would (before, a proxy
    skipped the probe, and a proxy that could not be reached cost the first lookup's retries)."""
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    from huggingface_hub.utils import _http
    monkeypatch.setattr(_http, "_GLOBAL_CLIENT", None, raising=False)  # (a client made with the proxy set)
    assert not hub._connects(constants.ENDPOINT) and unreachable.asked == ["proxy.invalid"]


def test_a_host_that_accepts_the_connection_and_never_answers_is_unreachable(monkeypatch):
    """A connection opens (a captive portal, a hanging proxy) and no answer comes: one probe's seconds, then the
    cache alone. A TCP connection alone said yes, and the first lookup waited its retries (23 s)."""
    import threading
    import time
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held = []
    threading.Thread(target=lambda: held.append(server.accept()), daemon=True).start()
    monkeypatch.setattr(hub, "PROBE_SECONDS", 0.5)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    t0 = time.perf_counter()
    try:
        assert not hub._connects(f"http://127.0.0.1:{server.getsockname()[1]}")
    finally:
        server.close()
    assert held and time.perf_counter() - t0 < 5
