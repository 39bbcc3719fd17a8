"""Text data for the built-in language models, tokenized offline at the byte level.

Every byte is a token (ids 0-255, valid for any vocabulary of 256 or more), so no tokenizer is
downloaded. ``--data`` names a text file or a folder (its ``.txt``, ``.md``, ``.py``, ``.rst`` files,
sorted); with none, the Python standard library's own source files, which every machine with
Python has. Sample ``s`` is the window of ``seq_len + 1`` bytes starting at byte ``s * (seq_len + 1)``
(wrapping around), so a batch is consecutive windows and a resumed run, which restarts the sampler
at the number of samples already seen, sees exactly the data it would have seen.

Batches come from a ``torch.utils.data.DataLoader``: with worker processes and pinned memory when
training on a GPU (the next batch is cut and copied while the step runs), in the main process on
a CPU, where a batch costs microseconds and worker processes would take cores from the step.
"""

from __future__ import annotations

import sys
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



class TextWindows(torch.utils.data.Dataset):
    """Sample ``s`` of a corpus: ``seq_len + 1`` token ids from byte ``s * (seq_len + 1)``, wrapping."""

    def __init__(self, corpus: ByteCorpus, seq_len: int):
        self.data, self.window = corpus.data, seq_len + 1
        if self.data.numel() < self.window:
            raise UserError(f"--data {corpus.source!r} has {self.data.numel()} bytes, fewer than one sequence of "
                            f"{self.window}; give more text or a shorter --seq-len")

    def __len__(self) -> int:
        return sys.maxsize  # endless: the sampler decides how many

    def __getitem__(self, sample: int) -> torch.Tensor:
        n = self.data.numel()
        start = (sample * self.window) % n
        if start + self.window <= n:
            return self.data[start:start + self.window].clone()
        return self.data[(torch.arange(self.window) + start) % n]


def text_batches(corpus: ByteCorpus, seq_len: int, batch_size: int, *, first_sample: int, num_batches: int,
                 workers: int = 0, pin_memory: bool = False):
    """Batches ``{"input_ids", "labels"}`` of ``batch_size`` windows, from sample ``first_sample``."""
    dataset = TextWindows(corpus, seq_len)
    samples = range(first_sample, first_sample + num_batches * batch_size)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=samples, num_workers=workers,
                                         pin_memory=pin_memory, persistent_workers=False,
                                         prefetch_factor=2 if workers else None,
                                         # its own generator: creating the iterator draws a seed from it,
                                         # which must not move the global RNG (a resumed run would drift)
                                         generator=torch.Generator().manual_seed(0))
    for ids in loader:
        yield {"input_ids": ids, "labels": ids}
