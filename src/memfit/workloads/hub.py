"""Hugging Face hub ids as workloads: ``meta-llama/Llama-3.1-8B`` or ``org/name@revision``.

How a hub id is read: NOTE [ Hub ids ].

Naming: an existing folder always wins (``./org/name`` on disk is that folder); ``hf:X`` reads
``X`` as a folder when it exists, else as a hub id (``hf:gpt2`` is the hub's ``gpt2``, not the
built-in). A revision (a branch, tag or commit) follows an ``@``: ``org/name@main``,
``org/name@0e9e39f``; repository names cannot hold an ``@``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlparse

from memfit.errors import UserError, brief
from memfit.quiet import logger_errors_only

_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}(?:@[\w./-]+)?$")


def is_hub_id(text: str, *, bare_names: bool = False) -> bool:
    """``org/name`` (or ``name`` with ``bare_names``), optionally ``@revision``: a hub id by form.
    Paths written as paths (``./x``, ``../x``, ``/x``, ``~/x``) and Python files are not."""
    if not _HUB_ID.match(text) or text.endswith((".py", ".json")) or ".." in text:
        return False
    return bare_names or "/" in text.split("@", 1)[0]


def split_hub_id(text: str) -> tuple[str, str | None]:
    """``org/name@rev`` -> (``org/name``, ``rev``); no ``@``: (text, None)."""
    repo_id, _, revision = text.partition("@")
    return repo_id, revision or None


# NOTE [ Hub ids ]
# memfit needs a model's architecture, never its weights, so a hub id costs one small file:
# ``config.json``, fetched with ``huggingface_hub.hf_hub_download`` into the hub's own cache
# (``HF_HOME`` / ``HF_HUB_CACHE``), where every Hugging Face tool finds it again. The hub library does
# the rest as it does for ``transformers``: a cached file is used without the network (always with
# ``HF_HUB_OFFLINE=1``), and gated or private repositories read the token of ``HF_TOKEN`` or ``hf auth
# login``. The snapshot folder holding that config.json is then a model folder like any other (NOTE [
# Model folders ] in :mod:`memfit.workloads.hf`): one path builds the model.
def hub_config_folder(text: str) -> Path:
    """The folder of the hub cache's snapshot holding ``config.json`` of hub id ``text``, fetched
    if it is not cached (nothing else is downloaded). One-line UserErrors name the fix."""
    try:
        from huggingface_hub import constants
        from huggingface_hub import errors as hub_errors
    except ImportError:
        raise UserError(f"hub model {text}: reading a hub id needs huggingface_hub; install it with "
                        "pip install 'memfit[hf]' (or pip install huggingface_hub)") from None
    repo_id, revision = split_hub_id(text)
    where = f"hub model {text}"
    local = f" (and no folder {repo_id} here)" if "/" in repo_id else ""
    login = "log in with `hf auth login` or set HF_TOKEN"
    download = _Lookups()  # NOTE [ A hub that cannot be reached ]
    try:
        with logger_errors_only("huggingface_hub"):  # its retries log a line each; the error below is the one line the user reads
            try:
                folder = Path(download(repo_id, "config.json", revision=revision)).parent
                _image_processor_config(download, repo_id, revision, folder)
                return folder
            except (hub_errors.LocalEntryNotFoundError, hub_errors.EntryNotFoundError) as missing:
                folder = _diffusers_denoiser(download, repo_id, revision, where) or \
                    _adapter_folder(download, repo_id, revision)
                if folder is None:
                    raise missing from None
                return folder
    except hub_errors.GatedRepoError:
        raise UserError(f"{where} is gated; accept its terms at https://huggingface.co/{repo_id} and {login}") from None
    except hub_errors.RepositoryNotFoundError:
        raise UserError(f"{where} not found on the Hugging Face hub{local}; check the id, or {login} if it "
                        "is private") from None
    except hub_errors.RevisionNotFoundError:
        raise UserError(f"{where}: revision {revision!r} not found; give a branch, tag or commit of "
                        f"{repo_id} after the @") from None
    except hub_errors.LocalEntryNotFoundError:
        cache = constants.HF_HUB_CACHE
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        raise UserError(f"{where}: config.json is not in the Hugging Face cache ({cache}) and {why}{local}; "
                        f"run `hf download {repo_id} config.json` where the hub can be reached (into the same "
                        "HF_HOME; a diffusers pipeline: model_index.json and unet/config.json or "
                        "transformer/config.json; a PEFT adapter: adapter_config.json), or give a folder holding "
                        "config.json") from None
    except hub_errors.EntryNotFoundError:
        raise UserError(f"{where} has no config.json, model_index.json or adapter_config.json (not a transformers, "
                        "diffusers or PEFT model); "
                        "give a model repository, "
                        "or write a file workload (path/to/file.py:NAME) that builds it") from None
    except hub_errors.HFValidationError as e:
        raise UserError(f"{where} is not a valid hub id ({brief(e, 120)}); write org/name or "
                        "org/name@revision") from None
    except hub_errors.HfHubHTTPError as e:
        raise UserError(f"{where}: the hub refused config.json ({brief(e, 120)}); {login}, or try "
                        "again later") from None


def _diffusers_denoiser(download, repo_id: str, revision: str | None, where: str) -> Path | None:
    """A diffusers pipeline's denoiser folder (its ``model_index.json``, then the ``unet`` or
    ``transformer`` config it names: NOTE [ diffusers repositories ]), or None if the repository has no
    model_index.json (cached, or on the hub)."""
    from huggingface_hub import errors as hub_errors

    from memfit.workloads import diffusers_folders
    from memfit.workloads.text_encoders import text_components
    try:
        index = Path(download(repo_id, "model_index.json", revision=revision))
    except (hub_errors.LocalEntryNotFoundError, hub_errors.EntryNotFoundError):
        return None
    data = diffusers_folders.read_model_index(index, where)
    name = diffusers_folders.denoiser_name(data, where)
    folder = Path(download(repo_id, f"{name}/config.json", revision=revision)).parent
    for encoder in text_components(data):  # (for a step that holds them: small files)
        try:
            download(repo_id, f"{encoder}/config.json", revision=revision)
        except Exception:  # noqa: BLE001 - optional: missing, offline, gated: built from the denoiser's widths
            pass
    return folder


def _image_processor_config(download, repo_id: str, revision: str | None, folder: Path) -> None:
    """A vision-language model's ``preprocessor_config.json`` beside its config.json, where the repository
    has one (NOTE [ Image-text batches ] in memfit.workloads.image_text); its defaults serve otherwise."""
    try:
        if "vision_config" in json.loads((folder / "config.json").read_text(encoding="utf-8")):
            download(repo_id, "preprocessor_config.json", revision=revision)
    except Exception:  # noqa: BLE001 - optional: missing, offline, unreadable: the processor's defaults serve
        pass


def _adapter_folder(download, repo_id: str, revision: str | None) -> Path | None:
    """A PEFT adapter's folder (its ``adapter_config.json``: NOTE [ Adapter checkpoints ]), or None."""
    from huggingface_hub import errors as hub_errors
    try:
        return Path(download(repo_id, "adapter_config.json", revision=revision)).parent
    except (hub_errors.LocalEntryNotFoundError, hub_errors.EntryNotFoundError):
        return None


# NOTE [ A hub that cannot be reached ]
# Where the hub cannot be reached and HF_HUB_OFFLINE is not set (a cluster node, a train, a firewall),
# huggingface_hub answers a lookup of a file it has not cached after five retries with backoff: 23 s with
# huggingface_hub 2.4 when the host name does not resolve (a cached file is answered at once). A hub id
# costs several lookups: config.json, else a pipeline's model_index.json and its denoiser's config, then
# optional ones (its text encoders' configs, a vision-language model's preprocessor_config.json). So
# an estimate of a pipeline whose model_index.json and transformer/config.json were cached, as memfit's
# own message advises, waited 70 s offline, every run, and an id not cached at all waited 70 s for its
# one-line error. Now, before a process's first lookup, the hub is asked once for its front page's headers,
# through huggingface_hub's own HTTP client and its proxies, with no retry (``PROBE_SECONDS`` at most: a name
# that does not resolve fails at once, a firewall that drops the packets at the timeout, and a connection that
# opens on a host that never answers, a captive portal's or a proxy's that hangs, at the timeout too: a TCP
# connection alone said yes there, and the first lookup then waited its 23 s of retries); where it fails, and
# once any lookup could not reach the hub, the lookups read the cache alone (``local_files_only``).
# Files cached answer as before; a hub that answers, whatever its status, is asked as before.
_REACHABLE: dict[str, bool] = {}
"""Hub endpoint -> whether this process found it reachable (NOTE [ A hub that cannot be reached ])."""
PROBE_SECONDS = 4.0
"""The longest the one request before the lookups waits (the hub answers a HEAD in well under a second)."""


class _Lookups:
    """``hf_hub_download``, cache-only once the hub is found unreachable (NOTE [ A hub that cannot be reached ])."""

    def __init__(self) -> None:
        from huggingface_hub import constants
        self.endpoint, self.offline = constants.ENDPOINT, constants.HF_HUB_OFFLINE  # (offline: cache-only anyway)
        if not self.offline and self.endpoint not in _REACHABLE:
            _REACHABLE[self.endpoint] = _connects(self.endpoint)

    def __call__(self, repo_id: str, filename: str, revision: str | None = None) -> str:
        from huggingface_hub import errors, hf_hub_download
        cache_only = _REACHABLE.get(self.endpoint) is False
        try:
            return hf_hub_download(repo_id, filename, revision=revision, local_files_only=cache_only)
        except errors.LocalEntryNotFoundError:
            if not (cache_only or self.offline):  # (neither cached nor reachable: the hub did not answer)
                _REACHABLE[self.endpoint] = False
            raise


def _connects(endpoint: str) -> bool:
    """The endpoint answers a HEAD request within ``PROBE_SECONDS``, through huggingface_hub's HTTP client (its
    proxies too), whatever the status (True: ask the hub)."""
    if not urlparse(endpoint).hostname:
        return True
    from huggingface_hub.utils import get_session
    try:
        get_session().head(endpoint, timeout=PROBE_SECONDS)
    except Exception:  # (no such host, no name service, refused, timed out, a proxy that fails: no answer)
        return False
    return True
