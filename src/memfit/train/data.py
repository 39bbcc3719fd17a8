"""Text data for the built-in language models, tokenized offline at the byte level.

Every byte is a token (ids 0-255, valid for any vocabulary of 256 or more), so no tokenizer is
downloaded. ``--data`` names a text file or a folder (its ``.txt``, ``.md``, ``.py``, ``.rst`` files,
sorted); with none, the Python standard library's own source files, which every machine with
Python has. Batches are consecutive windows of ``seq_len + 1`` bytes read from a position that
checkpoints save, so a resumed run sees exactly the data it would have seen.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from memfit.errors import UserError

SUFFIXES = (".txt", ".md", ".py", ".rst")
DEFAULT_CAP_BYTES = 16 << 20


def default_corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


class ByteCorpus:
    def __init__(self, path: str | None = None, cap_bytes: int = DEFAULT_CAP_BYTES):
        if path is None:
            files, self.source = default_corpus_files(), "the Python standard library's source files"
        else:
            p = Path(path)
            if not p.exists():
                raise UserError(f"--data {path!r} not found; give a text file or a folder of .txt/.md/.py files")
            files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix in SUFFIXES and f.is_file())
            self.source = str(p)
        chunks, total = [], 0
        for f in files:
            data = f.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= cap_bytes:
                break
        raw = b"".join(chunks)[:cap_bytes]
        if len(raw) < 2:
            raise UserError(f"--data {self.source!r} holds no text; give a non-empty text file or folder")
        self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()

    def batch(self, position: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, int]:
        """[batch_size, seq_len + 1] token ids from ``position``; returns them and the next position."""
        window = seq_len + 1
        need = batch_size * window
        n = self.data.numel()
        if n < window:
            raise UserError(f"--data {self.source!r} has {n} bytes, fewer than one sequence of {window}; "
                            "give more text or a shorter --seq-len")
        idx = (torch.arange(need) + position) % n
        return self.data[idx].view(batch_size, window), (position + need) % n
