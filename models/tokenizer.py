"""Byte-level BPE tokenizer rebuilt from GGUF ``tokenizer.ggml.*`` metadata.

The GGUF is the only artifact the runtime gets, so the tokenizer is built from
its metadata (tokens, token types, merges, pre-tokenizer name) on top of the
Hugging Face ``tokenizers`` library, and behaves like llama.cpp's
``llama_tokenize`` / ``llama_token_to_piece`` where the two libraries differ:

* Normalisation: ``normalize="nfc"`` (default) matches the official HF
  tokenizer (and tiktoken); ``normalize=None`` matches llama.cpp, which does not
  normalise. The two differ only on input that is not already NFC (decomposed
  accents); every prompt we ship is NFC.
* ``parse_special``: CONTROL (and UNKNOWN) tokens are matched in the text only
  when it is true (llama.cpp ``-sp`` / chat prompts); USER_DEFINED tokens such
  as ``<think>`` are always matched, as in llama.cpp and HF.
* Decoding copies CONTROL/USER_DEFINED text as is, maps NORMAL/BYTE tokens back
  through the GPT-2 byte table, and drops UNUSED (``[PAD..]``) ids, as
  ``llama_token_to_piece`` does.

``from_metadata`` checks every key it reads (types, token types, merges naming
tokens of the vocabulary, special ids inside it) and raises TokenizerError naming
the file and the key: dflash-compile builds the tokenizer, so a file that
compiles loads.
"""

from __future__ import annotations

import base64
import codecs
import threading
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from os import PathLike
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    """Tokenizer metadata that does not describe a usable tokenizer; names the file and key."""


class TokenType(IntEnum):
    """llama.cpp ``llama_token_type`` values stored in ``tokenizer.ggml.token_type``."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Pre-tokenizer split patterns by llama.cpp ``tokenizer.ggml.pre`` name, applied in order
# (each splits the pieces the previous one left), as llama.cpp's llm_tokenizer_bpe does.
# qwen35 differs from qwen2 only by treating combining marks (\p{M}) as letters; smollm
# (StarCoder's) isolates every digit, then splits GPT-2's way; llama-bpe is Llama 3's.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
PRE_TOKENIZER_REGEXES = {
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "qwen35": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "smollm": (r"\p{N}", _GPT2_REGEX),
    "llama-bpe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}
# llama.cpp takes a pre-token that is itself a vocabulary entry whole, without merging (Llama 3).
IGNORE_MERGES = frozenset({"llama-bpe"})

# Tokens llama.cpp marks as end-of-generation by their text (Qwen family).
EOG_TOKEN_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")

_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)
_ADDED_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


BYTE_TO_UNICODE = _bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def _to_unicode(token: bytes) -> str:
    return "".join(BYTE_TO_UNICODE[b] for b in token)


def read_tiktoken_ranks(path: str | PathLike) -> dict[bytes, int]:
    """Read a ``.tiktoken`` file (``base64(token) rank`` per line)."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _last_merge(token: bytes, ranks: Mapping[bytes, int], rank: int) -> tuple[bytes, bytes] | None:
    """BPE-merge ``token`` with ranks below its own; its merge is the final pair, if any.

    This is how tiktoken-to-HF converters recover merges: a token is reachable
    by BPE iff merging its bytes with lower ranks stops at exactly two parts.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    pair_ranks = [ranks.get(token[i : i + 2], rank) for i in range(len(token) - 1)]
    while len(parts) > 2:
        best = min(pair_ranks)
        if best >= rank:
            return None
        at = pair_ranks.index(best)
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
        del pair_ranks[at]
        if at > 0:
            pair_ranks[at - 1] = ranks.get(parts[at - 1] + parts[at], rank)
        if at < len(parts) - 1:
            pair_ranks[at] = ranks.get(parts[at] + parts[at + 1], rank)
    return (parts[0], parts[1]) if len(parts) == 2 else None


def merges_from_ranks(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Merges recovered from tiktoken ranks, ordered by the rank of the merged token."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1 and (pair := _last_merge(token, ranks, rank)) is not None:
            merges.append(pair)
    return merges


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's splits of pre-type `pre`, then GPT-2's byte-to-unicode mapping."""
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_REGEXES[pre]]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


class Tokenizer:
    """A GGUF vocabulary as a ``tokenizers`` BPE plus llama.cpp's token types and ids."""

    def __init__(
        self,
        tokens: Sequence[str],
        token_type: Sequence[int],
        merges: Iterable[tuple[str, str]],
        *,
        pre: str,
        normalize: str | None = "nfc",
        eos_id: int | None = None,
        bos_id: int | None = None,
        padding_id: int | None = None,
        mask_id: int | None = None,
        eot_ids: Iterable[int] = (),
        add_bos: bool = False,
        source: str = "<tokenizer>",
    ):
        if pre not in PRE_TOKENIZER_REGEXES:
            raise TokenizerError(
                f"{source}: unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
                f"supported: {sorted(PRE_TOKENIZER_REGEXES)}"
            )
        if normalize not in ("nfc", None):
            raise ValueError(f"{source}: normalize must be 'nfc' or None, not {normalize!r}")
        if len(token_type) != len(tokens):
            raise TokenizerError(f"{source}: {len(tokens)} tokens but {len(token_type)} token types")
        self.tokens = list(tokens)
        self.token_type = [TokenType(t) for t in token_type]
        bad = next((i for i, (t, ty) in enumerate(zip(self.tokens, self.token_type))
                    if ty in (TokenType.NORMAL, TokenType.BYTE) and not UNICODE_TO_BYTE.keys() >= set(t)), None)
        if bad is not None:
            raise TokenizerError(f"{source}: token {bad} {self.tokens[bad]!r} is {self.token_type[bad].name} but not "
                                 "byte-level text (each character one of the 256 GPT-2 byte characters)")
        self.merges = list(merges)
        self.pre = pre
        self.pre_regexes = PRE_TOKENIZER_REGEXES[pre]
        self.normalize = normalize
        self.eos_id, self.bos_id, self.padding_id, self.mask_id = eos_id, bos_id, padding_id, mask_id
        self.add_bos = add_bos
        self.source = source
        self._token_to_id = {}
        for i, t in enumerate(self.tokens):
            self._token_to_id.setdefault(t, i)
        named_eog = {self._token_to_id[t] for t in EOG_TOKEN_TEXTS if t in self._token_to_id}
        self.eos_ids = frozenset({i for i in (eos_id, *eot_ids) if i is not None} | named_eog)
        try:
            self._backend = self._build_backend()
        except Exception as e:  # the tokenizers library's own errors (merges it cannot use ...)
            raise TokenizerError(f"{source}: the tokenizer cannot be built: {e}") from None
        self._lock = threading.Lock()

    def _build_backend(self) -> _HFTokenizer:
        # Added tokens are also put in the BPE vocabulary so that ``add_tokens``
        # keeps their GGUF ids instead of numbering them after the vocabulary.
        # UNUSED ids stay out: tokenizers then neither produces nor decodes them.
        vocab = {}
        for i, (t, ty) in enumerate(zip(self.tokens, self.token_type)):
            if ty != TokenType.UNUSED:
                vocab.setdefault(t, i)
        backend = _HFTokenizer(models.BPE(vocab, self.merges, ignore_merges=self.pre in IGNORE_MERGES))
        if self.normalize == "nfc":
            backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = byte_level_pre_tokenizer(self.pre)
        backend.decoder = decoders.ByteLevel()
        backend.add_tokens(
            [
                AddedToken(t, special=ty in _SPECIAL_TYPES, normalized=False)
                for t, ty in zip(self.tokens, self.token_type)
                if ty in _ADDED_TYPES
            ]
        )
        return backend

    # ---- construction -------------------------------------------------------

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, Any], *, source: str = "<metadata>", normalize: str | None = "nfc"
    ) -> Tokenizer:
        """Build from GGUF key/values (``tokenizer.ggml.*``), each checked (TokenizerError)."""
        m = _MetadataCheck(metadata, source)
        model = m.get("model", str)
        if model != "gpt2":
            raise TokenizerError(
                f"{source}: unsupported tokenizer.ggml.model {model!r} (only 'gpt2' byte-level BPE is supported)"
            )
        tokens = m.strings("tokens")
        if not tokens:
            raise TokenizerError(f"{source}: tokenizer.ggml.tokens is empty")
        token_type = m.token_types(len(tokens))
        vocab = set(tokens)
        merges = [m.merge(i, text, vocab) for i, text in enumerate(m.strings("merges"))]
        ids = {key: m.token_id(key, len(tokens)) for key in _SPECIAL_ID_KEYS}
        return cls(
            tokens,
            token_type,
            merges,
            pre=m.get("pre", str),
            normalize=normalize,
            eos_id=ids["eos_token_id"],
            bos_id=ids["bos_token_id"],
            padding_id=ids["padding_token_id"],
            mask_id=ids["mask_token_id"],
            eot_ids=[i for i in (ids["eot_token_id"], ids["eom_token_id"]) if i is not None],
            add_bos=m.get("add_bos_token", bool, default=False),
            source=source,
        )

    @classmethod
    def from_gguf(cls, path: str | PathLike, *, normalize: str | None = "nfc") -> Tokenizer:
        from .gguf_file import open_gguf

        with open_gguf(path) as gguf:
            return cls.from_metadata(gguf.metadata, source=str(path), normalize=normalize)

    @classmethod
    def from_ranks(
        cls,
        ranks: Mapping[bytes, int],
        specials: Mapping[str, int],
        *,
        user_defined: Iterable[str] = (),
        pre: str = "qwen35",
        normalize: str | None = "nfc",
        source: str = "<ranks>",
    ) -> Tokenizer:
        """Build from tiktoken ranks (rank = id) the way GGUF converters do.

        ``specials`` become CONTROL tokens, except those named in
        ``user_defined`` (non-special added tokens such as ``<think>``); ids
        without a token become UNUSED ``[PAD<id>]`` entries.
        """
        user_defined = set(user_defined)
        n = max([*ranks.values(), *specials.values()]) + 1
        tokens = [f"[PAD{i}]" for i in range(n)]
        types = [TokenType.UNUSED] * n
        for token, rank in ranks.items():
            tokens[rank], types[rank] = _to_unicode(token), TokenType.NORMAL
        for text, i in specials.items():
            tokens[i] = text
            types[i] = TokenType.USER_DEFINED if text in user_defined else TokenType.CONTROL
        merges = [(_to_unicode(a), _to_unicode(b)) for a, b in merges_from_ranks(ranks)]
        return cls(tokens, types, merges, pre=pre, normalize=normalize, source=source)

    # ---- vocabulary ---------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids (embedding rows), UNUSED padding ids included."""
        return len(self.tokens)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (batch encoding, offsets)."""
        return self._backend

    def token_to_id(self, token: str) -> int | None:
        return self._token_to_id.get(token)

    def id_to_token(self, token_id: int) -> str:
        return self.tokens[token_id]

    def is_special(self, token_id: int) -> bool:
        return self.token_type[token_id] in _SPECIAL_TYPES

    def token_bytes(self, token_id: int, *, skip_special: bool = False) -> bytes:
        """The bytes a token stands for (llama.cpp ``token_to_piece``)."""
        ty = self.token_type[token_id]
        if ty in (TokenType.NORMAL, TokenType.BYTE):
            return bytes(UNICODE_TO_BYTE[c] for c in self.tokens[token_id])
        if ty == TokenType.USER_DEFINED or (ty in _SPECIAL_TYPES and not skip_special):
            return self.tokens[token_id].encode()
        return b""

    # ---- encode / decode ----------------------------------------------------

    def encode(self, text: str, *, parse_special: bool = True, add_special: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special`` prepends BOS when the vocabulary asks for it."""
        with self._lock:
            self._backend.encode_special_tokens = not parse_special
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        data = b"".join(self.token_bytes(i, skip_special=skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def stream_decoder(self, *, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.source}, vocab_size={self.vocab_size}, merges={len(self.merges)}, "
            f"pre={self.pre!r}, normalize={self.normalize!r})"
        )


_SPECIAL_ID_KEYS = ("eos_token_id", "bos_token_id", "padding_token_id", "mask_token_id", "eot_token_id",
                    "eom_token_id")
_ABSENT = object()


class _MetadataCheck:
    """Typed reads of ``tokenizer.ggml.<key>``; a wrong value is a TokenizerError naming it."""

    def __init__(self, metadata: Mapping[str, Any], source: str):
        self.metadata, self.source = metadata, source

    def error(self, key: str, problem: str) -> TokenizerError:
        return TokenizerError(f"{self.source}: tokenizer.ggml.{key} {problem}")

    def get(self, key: str, kind: type, default: Any = _ABSENT) -> Any:
        full = f"tokenizer.ggml.{key}"
        if full not in self.metadata:
            if default is _ABSENT:
                raise TokenizerError(f"{self.source}: missing {full}")
            return default
        value = self.metadata[full]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.error(key, f"is a {type(value).__name__}, not a {kind.__name__}")
        return value

    def strings(self, key: str) -> list[str]:
        values = self.get(key, list)
        if not all(isinstance(v, str) for v in values):
            raise self.error(key, "is not an array of strings")
        return values

    def token_types(self, n_tokens: int) -> list[int]:
        types = self.get("token_type", list, default=None)
        if types is None:
            return [TokenType.NORMAL] * n_tokens
        bad = next((i for i, t in enumerate(types) if not isinstance(t, int) or t not in _TYPE_VALUES), None)
        if bad is not None:
            raise self.error(f"token_type[{bad}]", f"= {types[bad]!r} is not a llama.cpp token type "
                                           f"({', '.join(f'{t.value} {t.name}' for t in TokenType)})")
        return types

    def merge(self, index: int, text: str, vocab: set[str]) -> tuple[str, str]:
        parts = tuple(text.split(" ", 1))
        if len(parts) != 2:
            raise self.error(f"merges[{index}]", f"= {text!r} is not two tokens separated by a space")
        for token in (*parts, parts[0] + parts[1]):
            if token not in vocab:
                raise self.error(f"merges[{index}]", f"= {text!r} names {token!r}, which is not in "
                                                     "tokenizer.ggml.tokens")
        return parts

    def token_id(self, key: str, n_tokens: int) -> int | None:
        value = self.get(key, int, default=None)
        if value is not None and not 0 <= value < n_tokens:
            raise self.error(key, f"= {value} is outside the vocabulary (0..{n_tokens - 1})")
        return value


_TYPE_VALUES = frozenset(t.value for t in TokenType)


class StreamDecoder:
    """Incremental detokenizer for generation: feed ids, get only complete UTF-8 text.

    A character split across tokens (CJK, emoji) is held back until its last
    byte arrives, so no replacement character appears mid-stream; invalid bytes
    still become U+FFFD as in ``decode``.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id, skip_special=self._skip_special))

    def flush(self) -> str:
        """Text of any held-back bytes (replacement characters for an unfinished sequence)."""
        return self._utf8.decode(b"", final=True)
