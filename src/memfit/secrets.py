"""Secrets memfit must never repeat: the Hugging Face token.

Hub ids are read through ``huggingface_hub`` (memfit.workloads.hub), which sends the token of
``HF_TOKEN`` (or ``hf auth login``'s token file) with its requests. memfit never asks for it, but a
token can still reach what memfit writes: an error message that echoes a request, a user's
workload that prints it or puts it in a name, a traceback under ``--debug``. So everything memfit
writes for people or disk goes through :func:`redact` (or a :class:`RedactingStream`): the
command's stdout and stderr (tracebacks included), report.json, plan files, metrics.jsonl and the
names and plans stored in checkpoints. A token is replaced by :data:`MASK`.

The token is found where ``huggingface_hub`` looks (``HF_TOKEN``, the older
``HUGGING_FACE_HUB_TOKEN``, the token file ``HF_TOKEN_PATH`` or ``$HF_HOME/token``, the stored
tokens of ``hf auth login``), and, when ``huggingface_hub`` is already imported, its own
``get_token()``. Importing this module reads nothing.
"""

from __future__ import annotations

import configparser
import os
import sys
from pathlib import Path

MASK = "hf_***"
TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
MIN_LENGTH = 8
"""Shorter values are not treated as tokens (masking them would mangle ordinary text)."""


def _hf_home() -> Path:
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "huggingface"


def tokens() -> tuple[str, ...]:
    """The Hugging Face tokens this process could send (longest first)."""
    found = {os.environ.get(name, "").strip() for name in TOKEN_VARIABLES}
    home = _hf_home()
    token_file = Path(os.environ.get("HF_TOKEN_PATH") or home / "token").expanduser()
    stored = Path(os.environ.get("HF_STORED_TOKENS_PATH") or home / "stored_tokens").expanduser()
    try:
        found.add(token_file.read_text().strip())
    except (OSError, UnicodeDecodeError):
        pass
    try:
        config = configparser.ConfigParser()
        config.read(stored)
        found.update(config[s].get("hf_token", "").strip() for s in config.sections())
    except (configparser.Error, UnicodeDecodeError):
        pass
    hub = sys.modules.get("huggingface_hub")
    if hub is not None:
        try:
            found.add((hub.get_token() or "").strip())
        except Exception:  # noqa: BLE001 - a broken token source is no token
            pass
    return tuple(sorted((t for t in found if len(t) >= MIN_LENGTH), key=len, reverse=True))


def redact(text: str, secrets: tuple[str, ...] | None = None) -> str:
    """``text`` with every token replaced by :data:`MASK`."""
    for secret in tokens() if secrets is None else secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def redact_data(value, secrets: tuple[str, ...] | None = None):
    """A JSON-like ``value`` (dicts, lists, tuples, strings) with every string redacted."""
    secrets = tokens() if secrets is None else secrets
    if not secrets:
        return value
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {redact_data(k, secrets): redact_data(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_data(v, secrets) for v in value)
    return value


class RedactingStream:
    """A text stream (stdout, stderr) that redacts what is written to it; everything else is the
    wrapped stream's. The tokens are read once, when it is made."""

    def __init__(self, stream):
        self._stream = stream
        self._secrets = tokens()

    def write(self, text: str) -> int:
        self._stream.write(redact(text, self._secrets) if self._secrets else text)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def redacting(stream):
    """``stream`` wrapped by a :class:`RedactingStream` (once)."""
    return stream if isinstance(stream, RedactingStream) or stream is None else RedactingStream(stream)
