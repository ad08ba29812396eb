"""The byte-table decoder's whole-character shortcut gives exactly what an incremental UTF-8 decoder gives over the
same bytes: characters split across tokens, invalid bytes, empty and out-of-range tokens, and a decoder restored
from another's state mid-character (a migrated stream)."""

from __future__ import annotations

import codecs
import random

import pytest

from tokenflow_ray.engine.detokenizer import ByteTable, ByteTableDecoder

PIECES = [b"a", b"hello", b" ", "é".encode(), "€".encode(), "€".encode()[:1], "€".encode()[1:], "😀".encode()[:2],
          "😀".encode()[2:], b"\xff", b"x\xc3", b"\xa9y", b"", "日本".encode(), b"\x80"]


def _reference(ids: list[int], table: list[bytes]) -> str:
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return "".join(utf8.decode(table[i] if 0 <= i < len(table) else b"") for i in ids) + utf8.decode(b"", final=True)


def test_table_texts_are_whole_characters_only():
    table = ByteTable(PIECES)
    assert table.texts[3] == "é" and table.texts[13] == "日本" and table.texts[12] == ""
    assert table.texts[5] is None and table.texts[9] is None and table.texts[10] is None


@pytest.mark.parametrize("seed", range(8))
def test_feed_equals_incremental_utf8(seed):
    rng = random.Random(seed)
    table = ByteTable(PIECES)
    for _ in range(50):
        ids = [rng.randrange(-1, len(PIECES) + 1) for _ in range(rng.randint(1, 30))]
        decoder = ByteTableDecoder(table)
        pieces = [decoder.feed(i) for i in ids]
        assert "".join(pieces) + decoder.flush() == _reference(ids, PIECES)
        # The same bytes, fed up to a cut, then continued by a decoder restored from that state.
        cut = rng.randrange(len(ids) + 1)
        first = ByteTableDecoder(table)
        head = "".join(first.feed(i) for i in ids[:cut])
        second = ByteTableDecoder(table)
        second.restore(first.state())
        assert head + "".join(second.feed(i) for i in ids[cut:]) + second.flush() == _reference(ids, PIECES)


def test_a_split_character_is_held_until_complete():
    decoder = ByteTableDecoder(ByteTable(PIECES))
    assert decoder.feed(5) == ""  # the euro sign's first byte
    assert decoder.feed(0) == "\ufffda"  # broken by an ASCII token: a replacement, then the letter
    assert decoder.feed(5) == "" and decoder.feed(6) == "€"
    assert decoder.feed(7) == "" and decoder.feed(3) == "\ufffdé"  # a whole-character token after a pending byte
