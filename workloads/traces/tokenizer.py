"""Tokenizers for text traces: a ``tokenizer.json`` (Hugging Face ``tokenizers``), a Hugging Face tokenizer folder
(its ``tokenizer.json``, else its ``tokenizer.model``), or a SentencePiece model; by default the Mistral v3
SentencePiece model shipped in ``mistral_common``. Every one offers what the loaders use: ``encode(texts)`` -> one
list of ids per text (no special tokens) and ``bos_id()`` (-1 when the tokenizer has none)."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

from mmcache.errors import TraceError
from mmcache.extras import require

TOKENIZER_FILES = ("mistral_instruct_tokenizer_240323.model.v3", "mistral_instruct_tokenizer_241114.model.v7",
                   "tokenizer.model.v1")
BOS_TOKENS = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")


def tokenizer_path() -> Path:
    """The SentencePiece model shipped in ``mistral_common/data`` (preferring the v3 instruct tokenizer)."""
    data = Path(str(resources.files("mistral_common") / "data"))
    for name in TOKENIZER_FILES:
        if (data / name).is_file():
            return data / name
    found = sorted(p for p in data.glob("*.model*") if p.is_file())
    if not found:
        raise FileNotFoundError(f"no SentencePiece model in {data}")
    return found[0]


class JsonTokenizer:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json``, with the SentencePiece-like calls the loaders use."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(str(path))
        self._bos = next((i for t in BOS_TOKENS if (i := self.tok.token_to_id(t)) is not None), -1)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def bos_id(self) -> int:
        return self._bos


@lru_cache(maxsize=4)
def load_tokenizer(path: str | Path | None = None):
    """The tokenizer at ``path`` (see the module docstring), loaded once; ``TraceError`` naming the path when it is
    none of the accepted kinds or cannot be read."""
    if path is None:
        require("replay", "the default tokenizer of agent and chat traces", "sentencepiece", "mistral_common")
        import sentencepiece
        return sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_path()))
    path = Path(path)
    if path.is_dir():
        found = next((path / n for n in ("tokenizer.json", "tokenizer.model") if (path / n).is_file()), None)
        if found is None:
            raise TraceError(path, None, "no tokenizer.json or tokenizer.model in this folder")
        path = found
    if not path.is_file():
        raise TraceError(path, None, "no such tokenizer file or folder")
    require("replay", f"--tokenizer {path}", "tokenizers" if path.suffix == ".json" else "sentencepiece")
    try:
        if path.suffix == ".json":
            return JsonTokenizer(path)
        import sentencepiece
        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError, ValueError, Exception) as e:  # both libraries raise bare Exception subclasses
        reason = str(e).splitlines()[0]
        raise TraceError(path, None, f"not a tokenizer.json or SentencePiece model ({reason})") from None
