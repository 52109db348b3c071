"""The tokenizer fingerprint kept beside a dataset, and the training-start check against it.

``preprocess_data.py`` writes ``PREFIX.tokenizer.json`` beside ``PREFIX.bin``/``PREFIX.idx``
(atomically, after the pair): the tokenizer's type, legacy flag, vocab size, EOD, the sha256 of
its files, and the dataset's largest token id. Megatron ignores the extra file; the ``.bin`` and
``.idx`` bytes are Megatron's.

At training start, each dataset is checked against the run's tokenizer:

- with a sidecar: the tokenizer files must be the same bytes, the EOD the same id, the options
  that move ids the same (TikTokenizer: pattern, special tokens), and the largest token id
  inside the vocab (a type or flag change that keeps the ids, such as
  ``GPTSentencePieceTokenizer`` vs ``SentencePieceTokenizer``, passes);
- without one (data made by Megatron or before sidecars): the largest token id of the whole
  ``.bin`` when it is small, else of evenly spaced windows of it (``SAMPLE_TOKENS`` tokens in all,
  so the check stays cheap on terabytes), must be inside the vocab.
"""

from __future__ import annotations

import json
import os

import numpy as np

from megafp8.data.indexed import data_file_path, index_file_path, read_header

SIDECAR_SUFFIX = ".tokenizer.json"
SIDECAR_FORMAT = "megafp8-tokenizer-sidecar"
SAMPLE_TOKENS = 1 << 20  # tokens read per dataset without a sidecar (whole .bin when smaller)
_WINDOWS = 16


def sidecar_path(prefix: str) -> str:
    return prefix + SIDECAR_SUFFIX


def remove_sidecar(prefix: str) -> None:
    """Drop a sidecar about to go stale (before the dataset it describes is replaced)."""
    if os.path.exists(sidecar_path(prefix)):
        os.remove(sidecar_path(prefix))


def write_sidecar(prefix: str, tokenizer, max_token_id: int, num_tokens: int, **extra) -> str:
    """Write ``PREFIX.tokenizer.json`` under a temporary name, fsync, rename."""
    doc = {
        "format": SIDECAR_FORMAT,
        "version": 1,
        **tokenizer.fingerprint(),
        "max_token_id": int(max_token_id),
        "num_tokens": int(num_tokens),
        **extra,
    }
    path = sidecar_path(prefix)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def read_sidecar(prefix: str) -> dict | None:
    path = sidecar_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable tokenizer sidecar ({exc}); delete it") from exc
    if not isinstance(doc, dict) or doc.get("format") != SIDECAR_FORMAT:
        raise ValueError(f"{path}: not a {SIDECAR_FORMAT} file")
    return doc


def sampled_max_token_id(prefix: str, budget: int = SAMPLE_TOKENS) -> tuple[int, bool]:
    """(largest token id, whether every token was read); -1 for an empty ``.bin``."""
    dtype = read_header(index_file_path(prefix))[0]
    path = data_file_path(prefix)
    n = os.path.getsize(path) // dtype.itemsize
    if n == 0:
        return -1, True
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    if n <= budget:
        return int(tokens.max()), True
    width = budget // _WINDOWS
    starts = np.linspace(0, n - width, _WINDOWS).astype(np.int64)
    return max(int(tokens[s : s + width].max()) for s in starts), False


def _describe(fp: dict) -> str:
    files = ", ".join(f"{k} sha256 {v[:12]}" for k, v in sorted(fp.get("files", {}).items()))
    legacy = " legacy" if fp.get("legacy") else ""
    opts = "".join(f", {k} {v}" for k, v in sorted(fp.get("options", {}).items()))
    return (
        f"{fp.get('tokenizer_type')}{legacy} ({files or 'no files'}; EOD {fp.get('eod')}, "
        f"vocab {fp.get('vocab_size')}{opts})"
    )


def check_dataset_tokenizer(prefix: str, tokenizer, padded_vocab: int | None = None) -> None:
    """Raise a one-line ValueError unless ``prefix`` was tokenized compatibly (module doc)."""
    mine = tokenizer.fingerprint()
    side = read_sidecar(prefix)
    if side is not None:
        same_files = sorted(side.get("files", {}).values()) == sorted(mine["files"].values())
        same_ids = side.get("eod") == mine["eod"] and side.get("options") == mine.get("options")
        if not same_files or not same_ids:
            null = side.get("tokenizer_type") == mine.get("tokenizer_type") == "NullTokenizer"
            flags = f"--vocab-size {side.get('vocab_size')}" if null else "the tokenizer flags"
            raise ValueError(
                f"{prefix}: tokenized with {_describe(side)}, but this run uses "
                f"{_describe(mine)}; pass {flags} used by preprocess_data.py "
                f"(see {sidecar_path(prefix)}) or preprocess again"
            )
        max_id, where = int(side.get("max_token_id", -1)), " (sidecar)"
    else:
        max_id, whole = sampled_max_token_id(prefix)
        where = "" if whole else f" (in a {SAMPLE_TOKENS}-token sample)"
    if max_id >= tokenizer.vocab_size:
        padded = f", padded {padded_vocab}" if padded_vocab else ""
        raise ValueError(
            f"{prefix}: holds token id {max_id}{where}, outside the vocab of {_describe(mine)}"
            f"{padded}: the data was tokenized with another tokenizer"
        )


def check_data_tokenizer(data_cfg, tokenizer, padded_vocab: int | None = None) -> None:
    """``check_dataset_tokenizer`` for every dataset of ``data_path`` and the per-split blends
    (none with mock data)."""
    from megafp8.config_values import dataset_prefixes

    if data_cfg.mock_data:
        return
    for prefix in dataset_prefixes(data_cfg):
        check_dataset_tokenizer(prefix, tokenizer, padded_vocab)
