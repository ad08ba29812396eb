"""The embedded model's training text: English that every CPython install carries, so training needs no download.

Two sources, both read without importing any of the modules they describe:
- the docstrings of the standard library's own `.py` files (module, class and function docstrings, via `ast`),
  one document per file, tests, IDLE, the turtle demos and lib2to3's fixers left out (mostly code or fixtures);
- `pydoc_data.topics`, the text behind `help("if")`, `help("FORMATTING")` and the like, one document per topic.

Documents, not bytes, are split into train and held out (about 5% by a hash of the document's name), so held-out
loss measures text the model never saw in any window. The result depends on the Python version; `corpus_digest`
names it in the training log.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
import zlib
from dataclasses import dataclass

import numpy as np

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3",
                          "__pycache__", "__phello__"})
HELD_OUT_MODULUS = 20  # a document is held out when crc32(name) % 20 == 0: about 5%
BOS, EOS = 256, 257  # the embedded tokenizer's <|begin_of_text|> and <|end_of_text|>


@dataclass(frozen=True)
class Document:
    name: str  # "stdlib:json/decoder.py" or "topic:if"
    text: str


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # int64 token ids: BOS + utf-8 bytes + EOS per document, concatenated
    held_out: np.ndarray
    train_documents: int
    held_out_documents: int
    digest: str  # sha256 over both streams, first 12 hex digits


def stdlib_docstring_documents(root: str | None = None) -> list[Document]:
    root = root or sysconfig.get_paths()["stdlib"]
    documents = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            path = os.path.join(dirpath, filename)
            text = _docstrings_of(path)
            if text:
                documents.append(Document("stdlib:" + os.path.relpath(path, root), text))
    return documents


def _docstrings_of(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 20:  # one-word docstrings teach nothing
                parts.append(doc.strip())
    return "\n\n".join(parts)


def pydoc_topic_documents() -> list[Document]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return []
    return [Document("topic:" + key, topics[key].strip()) for key in sorted(topics)]


def is_held_out(name: str) -> bool:
    return zlib.crc32(name.encode()) % HELD_OUT_MODULUS == 0


def encode_documents(documents: list[Document]) -> np.ndarray:
    pieces = []
    for doc in documents:
        pieces.append(np.array([BOS], dtype=np.int64))
        pieces.append(np.frombuffer(doc.text.encode("utf-8"), dtype=np.uint8).astype(np.int64))
        pieces.append(np.array([EOS], dtype=np.int64))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def build_corpus() -> Corpus:
    documents = stdlib_docstring_documents() + pydoc_topic_documents()
    train = [d for d in documents if not is_held_out(d.name)]
    held_out = [d for d in documents if is_held_out(d.name)]
    train_ids, held_ids = encode_documents(train), encode_documents(held_out)
    digest = hashlib.sha256(train_ids.tobytes() + b"|" + held_ids.tobytes()).hexdigest()[:12]
    return Corpus(train_ids, held_ids, len(train), len(held_out), digest)
