"""Incremental detokenisation that never emits a broken UTF-8 sequence, and stop-string matching.

Byte-level BPE tokenizers (GPT-2 style: the embedded model, Llama-3, Qwen2) get a token -> bytes table built once,
and each stream feeds bytes through an incremental UTF-8 decoder: a multi-byte character split across tokens is held
back until complete; invalid bytes become U+FFFD. Other tokenizers (SentencePiece) fall back to decoding a short
window of tokens and emitting the new suffix once it no longer ends in an incomplete character.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

REPLACEMENT = "\ufffd"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


class StreamDecoder(Protocol):
    def feed(self, token_id: int) -> str: ...
    def flush(self) -> str: ...
    def state(self) -> tuple: ...  # small and picklable: what a migrated stream carries to its new replica


class ByteTable:
    """A byte-level vocabulary's token -> bytes table, and each token's text where its bytes are whole UTF-8
    characters (None where a character is split or a byte is invalid): built once per tokenizer."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = tuple(pieces)
        self.texts = tuple(_whole_text(p) for p in self.pieces)


def _whole_text(piece: bytes) -> str | None:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return None


class ByteTableDecoder:
    def __init__(self, table: ByteTable) -> None:
        self._pieces, self._texts = table.pieces, table.texts
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        # Once per stream per step: with no character pending, a token of whole characters is its table text
        # (what the incremental decoder would return, leaving nothing pending), without the decoder's Python.
        if 0 <= token_id < len(self._texts):
            text = self._texts[token_id]
            if text is not None and not self._utf8.buffer:
                return text
            return self._utf8.decode(self._pieces[token_id])
        return self._utf8.decode(b"")

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)

    def state(self) -> tuple:
        return ("bytes", self._utf8.getstate())  # the bytes of a character not yet complete

    def restore(self, state: tuple) -> None:
        self._utf8.setstate(state[1])


class WindowDecoder:
    """Fallback for tokenizers without a byte table (vLLM's prefix/read-offset method)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens already turned into emitted text

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=True)
        full_text = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=True)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""  # an incomplete character: wait for the next token
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=True)
        full_text = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=True)
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text):]

    def state(self) -> tuple:
        # Only the decode window matters: tokens before it are already text.
        return ("window", tuple(self._ids[self._prefix:]), self._read - self._prefix)

    def restore(self, state: tuple) -> None:
        self._ids, self._prefix, self._read = list(state[1]), 0, state[2]


class DecoderFactory:
    """Builds one StreamDecoder per stream for a given HF tokenizer (the byte table is built once)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._table = _byte_table(tokenizer)

    def new(self) -> StreamDecoder:
        return ByteTableDecoder(self._table) if self._table is not None else WindowDecoder(self._tokenizer)

    def restore(self, state: tuple) -> StreamDecoder:
        """A decoder that continues where the one whose `state()` this is stopped (on another replica)."""
        decoder = self.new()
        expected = "bytes" if isinstance(decoder, ByteTableDecoder) else "window"
        if state[0] != expected:
            raise ValueError(f"detokenizer state: a {state[0]!r} decoder's state, this tokenizer needs {expected!r}")
        decoder.restore(state)
        return decoder


def _byte_table(tokenizer: Any) -> ByteTable | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or type(decoder).__name__ != "ByteLevel":
        return None
    inverse = {c: b for b, c in bytes_to_unicode().items()}
    special = set(getattr(tokenizer, "all_special_ids", ()))
    added = {i for i in getattr(tokenizer, "added_tokens_decoder", {})}
    table: list[bytes] = []
    for token_id in range(len(tokenizer)):
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token is None or token_id in special or token_id in added:
            table.append(b"")  # special and added tokens are skipped in output text
            continue
        try:
            table.append(bytes(inverse[c] for c in token))
        except KeyError:
            return None  # not a pure byte-level vocabulary after all
    return ByteTable(table)


@dataclass
class StopMatcher:
    """Holds back text that could still become a stop string; cuts the text at the first stop string."""

    stops: tuple[str, ...]
    pending: str = field(default="")  # text held back: a migrated stream carries it

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.pending = ""
            return buf[:cut], True
        hold = max((k for s in self.stops for k in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:k])), default=0)
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class TextState:
    """A stream's text as the engine makes it: its incremental decoder, its stop-string matcher, the text so far."""

    decoder: StreamDecoder
    stops: StopMatcher
    text: list[str] = field(default_factory=list)
