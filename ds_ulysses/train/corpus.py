"""Long training sequences of real text that need no download: the byte vocabulary and the packer.

The default corpus is the Python standard library's own source files, which every machine with
Python has: read in sorted path order (so every rank and every run sees the same stream), encoded
as UTF-8 bytes, joined with an end-of-document token and cut into samples of ``seq_len`` tokens.
A sample is one long document (position_ids ``0..seq_len-1``): long-context training is the point,
so attention spans the whole sample rather than restarting at each file.

``--data`` files (plain text, or JSONL with a ``"text"`` field) and a local HF tokenizer directory
replace the defaults; the packer is the same.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

__all__ = ["ByteVocab", "HFTokenizer", "load_tokenizer", "stdlib_texts", "file_texts", "PackedSamples"]

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class ByteVocab:
    """256 byte values plus specials: any text round-trips, and no tokenizer file is needed."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")

    def __init__(self):
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(256, 256 + len(self.SPECIALS))
        self.vocab_size = 256 + len(self.SPECIALS)
        self.source = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; specials are dropped and a multi-byte character cut by a sample boundary
        decodes as U+FFFD rather than raising."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local HF tokenizer behind the same four members as :class:`ByteVocab`."""

    def __init__(self, path: str | os.PathLike):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"tokenizer {path}: expected an eos token to separate documents, got none; "
                             "fix: use a tokenizer with eos_token set, or the default byte vocabulary")
        pad = self.tokenizer.pad_token_id
        self.pad_id = self.eos_id if pad is None else pad
        self.vocab_size = len(self.tokenizer)
        self.source = os.fspath(path)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(path: str | os.PathLike | None):
    """The byte vocabulary, or a local HF tokenizer directory (never downloaded)."""
    if path is None:
        return ByteVocab()
    if not Path(path).is_dir():
        raise FileNotFoundError(f"--tokenizer: expected a local HF tokenizer directory, got {os.fspath(path)!r} "
                                "(no such directory); fix: pass a directory saved with "
                                "tokenizer.save_pretrained(), or omit --tokenizer for the byte vocabulary")
    return HFTokenizer(path)


def stdlib_texts(root: str | os.PathLike | None = None) -> Iterator[str]:
    """The standard library's ``.py`` files in sorted path order, installed packages excluded.

    Files that are not valid UTF-8 (a few deliberately broken test fixtures) are skipped.
    """
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)  # os.walk descends in this order
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                text = (Path(dirpath) / name).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                yield text


def file_texts(paths: Iterable[str | os.PathLike]) -> Iterator[str]:
    """Documents from text files (one per file) and JSONL files (one per line's ``"text"``)."""
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--data: expected a text or .jsonl file, got {os.fspath(path)!r} "
                                    "(no such file); fix: check the path")
        if path.suffix != ".jsonl":
            yield path.read_text(encoding="utf-8")
            continue
        with path.open(encoding="utf-8") as lines:
            for lineno, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: expected one JSON object per line, got invalid JSON "
                                     f"({exc.msg}); fix: one {{\"text\": ...}} object per line") from exc
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    got = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f"{path}:{lineno}: expected an object with a string \"text\" field, got "
                                     f"{got}; fix: put each document's text under \"text\"")
                yield record["text"]


class PackedSamples(torch.utils.data.Dataset):
    """Samples ``i = 0..n-1`` of ``seq_len`` tokens cut from the document stream, built on first use.

    Only ``(offset + n) * seq_len`` tokens are ever read, so a run of a few dozen steps touches a few
    megabytes of the corpus. ``texts()`` yields the documents afresh on every call; a stream shorter
    than needed starts over from its first document (small ``--data`` files), so sample ``i`` depends
    only on the corpus and ``seq_len``, never on ``n``: resuming can take ``samples[k:]`` and see
    exactly what the uninterrupted run would have.
    Each item is ``{"input_ids": [seq_len], "labels": [seq_len]}``; the SP adapter shifts the labels.
    """

    def __init__(self, texts: Callable[[], Iterable[str]], tokenizer, seq_len: int, n: int, offset: int = 0):
        if seq_len < 2:
            raise ValueError(f"seq_len: expected at least 2 tokens, got {seq_len}; fix: pass --seq-len >= 2")
        self.texts, self.tokenizer = texts, tokenizer
        self.seq_len, self.n, self.offset = seq_len, n, offset
        self._tokens = None

    def __len__(self) -> int:
        return self.n

    def subset(self, start: int, n: int | None = None) -> PackedSamples:
        """Samples ``start..`` of this sequence (sharing the token stream read so far)."""
        rest = self.n - start if n is None else n
        out = PackedSamples(self.texts, self.tokenizer, self.seq_len, rest, self.offset + start)
        out._tokens = self._tokens
        return out

    def _stream(self) -> torch.Tensor:
        if self._tokens is None:
            need = (self.offset + self.n) * self.seq_len
            chunks, total = [], 0
            while total < need:
                before = total
                for text in self.texts():
                    chunks.append(torch.tensor(self.tokenizer.encode(text) + [self.tokenizer.eos_id]))
                    total += len(chunks[-1])
                    if total >= need:
                        break
                if total == before:
                    raise ValueError(f"corpus: expected documents to pack into {self.seq_len}-token samples, "
                                     "got none; fix: pass --data files that contain text")
            self._tokens = torch.cat(chunks)[:need]  # [tokens]
        return self._tokens

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} out of range [0, {self.n})")
        start = (self.offset + i) * self.seq_len
        ids = self._stream()[start:start + self.seq_len]
        return {"input_ids": ids.clone(), "labels": ids.clone()}
