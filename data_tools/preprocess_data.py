#!/usr/bin/env python3
"""JSONL text -> Megatron MMIDIDX token datasets ``{prefix}_{key}_document.bin/.idx``.

    python3 data_tools/preprocess_data.py --input corpus/ --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod \\
        --workers 8

Tokenizer flags are Megatron-LM's (``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file``,
``--merge-file``, ``--vocab-size``, ``--tokenizer-sentencepiece-legacy``) and mean what they mean
there; ``megafp8/data/tokenizer`` says what each type writes and which id is EOD. Beside each
output ``PREFIX.bin``/``PREFIX.idx`` goes ``PREFIX.tokenizer.json`` (the tokenizer's fingerprint
and the largest token id), which the training side checks its own tokenizer against.

One reader streams each input in blocks of whole lines to a pool of worker processes, which parse,
validate and tokenize; results are written in input order, so the output bytes are the same for
any ``--workers`` (and ``--partitions``). Memory stays bounded: a few blocks in flight, the index
spooled to disk. Outputs are written under temporary names and renamed only when complete.

Bad lines (malformed JSON, not an object, missing key, non-string text, invalid UTF-8) stop the
run with ``file:line: what was expected`` and exit status 1, leaving no output; with
``--skip-bad-lines`` they are skipped, counted, and their first locations reported.

Empty documents, as in Megatron: a text that tokenizes to nothing adds a document with no
sequence (two equal document-index entries) and gets no EOD, even under ``--append-eod``; the
GPT dataset then skips it. A value may also be a list of strings (Megatron's pre-split
sentences): each non-empty one becomes a sequence of the document, EOD after the last.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import sys
import time
from collections import deque

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megafp8.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype  # noqa: E402
from megafp8.data.jsonl import InputError, expand_inputs, iter_blocks, parse_block  # noqa: E402
from megafp8.data.tokenizer import remove_sidecar, write_sidecar  # noqa: E402
from megafp8.data.tokenizer.flags import (  # noqa: E402
    add_tokenizer_args,
    tokenizer_from_spec,
    tokenizer_spec,
)

MAX_REPORTED_BAD = 10


def get_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("input data")
    g.add_argument(
        "--input",
        required=True,
        nargs="+",
        help=".jsonl/.jsonl.gz/.jsonl.zst file(s), glob(s) or directory(ies)",
    )
    g.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to extract (one output each)"
    )
    g.add_argument(
        "--split-sentences",
        action="store_true",
        help="not supported: give pre-split sentences as a JSON list of strings instead",
    )
    g.add_argument(
        "--keep-newlines", action="store_true", help="accepted (newlines are always kept)"
    )
    g.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip malformed lines (counted and reported) instead of stopping",
    )
    g = p.add_argument_group("tokenizer")
    add_tokenizer_args(g)
    g.add_argument(
        "--append-eod", action="store_true", help="append EOD to every non-empty document"
    )
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument(
        "--workers",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="tokenizing processes (total over partitions)",
    )
    g.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="split the input files into this many groups processed concurrently, then "
        "merged in order (same bytes)",
    )
    g.add_argument(
        "--log-interval",
        type=int,
        default=1000,
        help="documents between progress lines when stderr is not a terminal",
    )
    g.add_argument("--block-bytes", type=int, default=1 << 20, help="bytes of lines per work item")
    args = p.parse_args(argv)
    if args.split_sentences:
        p.error("--split-sentences is not supported; pass sentences as a JSON list of strings")
    for name in ("workers", "partitions", "log_interval", "block_bytes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


_W: dict = {}


def _init_worker(tok_spec, keys, append_eod, dtype_name):
    _W.update(
        tok=tokenizer_from_spec(tok_spec),
        keys=keys,
        append_eod=append_eod,
        dtype=np.dtype(dtype_name),
    )


def _encode_key(tok, texts: list[list[str]], append_eod: bool, dtype):
    """Tokenize one key of many documents -> (tokens, sequence lengths, sequences per doc).

    Every id must lie in ``[0, tok.vocab_size)``, the vocab the training side pads.
    """
    flat = list(itertools.chain.from_iterable(texts))
    ids = tok.tokenize_batch(flat) if flat else []
    seqs, per_doc, at = [], np.zeros(len(texts), np.int64), 0
    for d, doc in enumerate(texts):
        kept = [s for s in ids[at : at + len(doc)] if s]
        at += len(doc)
        if kept and append_eod:
            kept[-1] = kept[-1] + [tok.eod]
        seqs.extend(kept)
        per_doc[d] = len(kept)
    lengths = np.fromiter(map(len, seqs), np.int64, len(seqs))
    try:  # (uint16 tokens: a negative id cannot be stored, so fromiter raises)
        tokens = np.fromiter(itertools.chain.from_iterable(seqs), dtype, int(lengths.sum()))
    except OverflowError as exc:
        raise ValueError(f"{tok!r} produced an id outside [0, {tok.vocab_size}): {exc}") from None
    if tokens.size and not 0 <= tokens.min() <= tokens.max() < tok.vocab_size:
        bad = int(tokens.max() if tokens.max() >= tok.vocab_size else tokens.min())
        raise ValueError(f"{tok!r} produced id {bad}, outside [0, {tok.vocab_size})")
    return tokens, lengths, per_doc


def encode_block(path: str, first_line: int, block: bytes):
    """Worker: parse and tokenize a block -> (per-key arrays, docs, bad lines, text bytes)."""
    docs, bad = parse_block(path, first_line, block, _W["keys"])
    try:
        out = [
            _encode_key(_W["tok"], [d[k] for d in docs], _W["append_eod"], _W["dtype"])
            for k in range(len(_W["keys"]))
        ]
    except ValueError as exc:  # e.g. NullTokenizer text that is not ids
        raise InputError(f"{path}: a line from {first_line} on: {exc}") from None
    return out, len(docs), bad, len(block)


class Progress:
    """tqdm bar over input bytes with docs/s, tokens/s, MB/s; plain lines when not a terminal."""

    def __init__(self, total_bytes: int, log_interval: int, position: int = 0, label: str = ""):
        from tqdm import tqdm

        self.t0, self.docs, self.tokens, self.text_bytes = time.perf_counter(), 0, 0, 0
        self.log_interval, self._next_log, self.label = log_interval, log_interval, label
        tty = sys.stderr.isatty()
        self.bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            position=position,
            desc=label or "preprocess",
            disable=not tty,
            mininterval=0.5,
        )

    def rates(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return (
            f"{self.docs / dt:,.0f} docs/s, {self.tokens / dt:,.0f} tokens/s, "
            f"{self.text_bytes / dt / 1e6:.1f} MB/s"
        )

    def update(self, raw_bytes: int, docs: int, tokens: int, text_bytes: int) -> None:
        self.docs, self.tokens, self.text_bytes = (
            self.docs + docs,
            self.tokens + tokens,
            self.text_bytes + text_bytes,
        )
        self.bar.update(raw_bytes)
        if not self.bar.disable:
            self.bar.set_postfix_str(self.rates(), refresh=False)
        elif self.docs >= self._next_log:
            print(
                f"{self.label}processed {self.docs:,} documents ({self.rates()})",
                file=sys.stderr,
                flush=True,
            )
            self._next_log = (self.docs // self.log_interval + 1) * self.log_interval

    def close(self) -> None:
        self.bar.close()


def new_stats(keys) -> dict:
    return {"docs": 0, "tokens": 0, "bad": 0, "bad_lines": [], "max_id": dict.fromkeys(keys, -1)}


def write_sidecars(args, stats) -> None:
    """``PREFIX.tokenizer.json`` beside each finished dataset (fingerprint, largest id)."""
    tok = tokenizer_from_spec(tokenizer_spec(args))
    for key, prefix in output_prefixes(args.output_prefix, args.json_keys).items():
        ntok = IndexedDataset(prefix, validate=False).num_tokens
        write_sidecar(prefix, tok, stats["max_id"][key], ntok, append_eod=bool(args.append_eod))


def output_prefixes(prefix: str, keys) -> dict[str, str]:
    return {k: f"{prefix}_{k}_document" for k in keys}


def _blocks(files, block_bytes):
    for path in files:
        last = 0
        for first, block, raw in iter_blocks(path, block_bytes):
            yield path, first, block, raw - last
            last = raw


def process_files(files, prefix: str, args, workers: int, position: int = 0) -> dict:
    """Tokenize ``files`` into ``prefix``'s datasets with ``workers`` processes; return stats."""
    spec = tokenizer_spec(args)
    dtype = best_dtype(tokenizer_from_spec(spec).vocab_size)
    prefixes = output_prefixes(prefix, args.json_keys)
    writers = {k: IndexedDatasetWriter(p, dtype) for k, p in prefixes.items()}
    stats = new_stats(args.json_keys)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    pool = ctx.Pool(workers, _init_worker, (spec, args.json_keys, args.append_eod, dtype.name))
    progress = Progress(
        sum(os.path.getsize(f) for f in files),
        args.log_interval,
        position,
        f"[part {position}] " if position or args.partitions > 1 else "",
    )
    pending: deque = deque()

    def drain_one():
        res, raw = pending.popleft()
        per_key, ndocs, bad, nbytes = res.get()
        if bad:
            if not args.skip_bad_lines:
                raise InputError(f"{bad[0]} (use --skip-bad-lines to skip such lines)")
            stats["bad"] += len(bad)
            room = MAX_REPORTED_BAD - len(stats["bad_lines"])
            stats["bad_lines"].extend(str(b) for b in bad[: max(room, 0)])
        ntok = 0
        for key, (tokens, lengths, per_doc) in zip(args.json_keys, per_key, strict=True):
            writers[key].add_documents(tokens, lengths, per_doc)
            ntok += tokens.size
            if tokens.size:
                stats["max_id"][key] = max(stats["max_id"][key], int(tokens.max()))
        stats["docs"] += ndocs
        stats["tokens"] += ntok
        progress.update(raw, ndocs, ntok, nbytes)

    try:
        for path, first, block, raw in _blocks(files, args.block_bytes):
            pending.append((pool.apply_async(encode_block, (path, first, block)), raw))
            if len(pending) >= 2 * workers + 2:
                drain_one()
        while pending:
            drain_one()
        for key, w in writers.items():
            remove_sidecar(prefixes[key])  # the old one would describe the old dataset
            w.finalize()
    except BaseException:
        pool.terminate()
        for w in writers.values():
            w.abort()
        raise
    finally:
        progress.close()
        pool.close()
        pool.join()
    return stats


def _partition_files(files, parts: int) -> list[list[str]]:
    """Contiguous groups of files (order kept) with about equal bytes each."""
    sizes = np.array([os.path.getsize(f) for f in files], np.float64)
    bounds = np.searchsorted(np.cumsum(sizes), np.linspace(0, sizes.sum(), parts + 1)[1:-1])
    groups, lo = [], 0
    for b in list(np.minimum(bounds + 1, len(files))) + [len(files)]:
        if b > lo:
            groups.append(files[lo:b])
            lo = b
    return groups


def _run_part(queue, files, prefix, args, workers, position):
    try:
        queue.put((position, "ok", process_files(files, prefix, args, workers, position)))
    except BaseException as exc:  # reported by the parent, which cleans up
        queue.put((position, "error", str(exc) if isinstance(exc, InputError) else repr(exc)))


def run_partitions(files, args) -> dict:
    """Process file groups concurrently into part datasets, then merge them in order."""
    groups = _partition_files(files, min(args.partitions, len(files)))
    per = max(1, args.workers // len(groups))
    tag = f".part-{os.getpid()}-"
    parts = [f"{args.output_prefix}{tag}{i}" for i in range(len(groups))]
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_run_part, args=(queue, g, parts[i], args, per, i))
        for i, g in enumerate(groups)
    ]
    results, error = {}, None
    try:
        for pr in procs:
            pr.start()
        for _ in procs:
            i, status, payload = queue.get()
            if status == "error":
                error = payload
                break
            results[i] = payload
        if error:
            raise InputError(error)
        tok = tokenizer_from_spec(tokenizer_spec(args))
        for key, out in output_prefixes(args.output_prefix, args.json_keys).items():
            remove_sidecar(out)
            with IndexedDatasetWriter(out, best_dtype(tok.vocab_size)) as w:
                for part in parts:
                    w.add_index(output_prefixes(part, [key])[key])
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.terminate()
            pr.join()
        for part in parts:
            for p in output_prefixes(part, args.json_keys).values():
                for suffix in (".bin", ".idx"):
                    if os.path.exists(p + suffix):
                        os.remove(p + suffix)
    stats = new_stats(args.json_keys)
    for i in sorted(results):
        for k in ("docs", "tokens", "bad"):
            stats[k] += results[i][k]
        stats["bad_lines"].extend(results[i]["bad_lines"])
        for key, m in results[i]["max_id"].items():
            stats["max_id"][key] = max(stats["max_id"][key], m)
    stats["bad_lines"] = stats["bad_lines"][:MAX_REPORTED_BAD]
    return stats


def check_before_work(args) -> list[str]:
    """Every cheap check first: inputs, compression suffixes, tokenizer, output directory."""
    from megafp8.data.jsonl import compression_of

    files = expand_inputs(args.input)
    for f in files:
        compression_of(f)
    tok = tokenizer_from_spec(tokenizer_spec(args))
    if len(set(args.json_keys)) != len(args.json_keys):
        raise ValueError(f"--json-keys {args.json_keys} repeats a key")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    if not os.access(out_dir, os.W_OK):
        raise ValueError(f"{out_dir}: output directory is not writable")
    print(
        f"{len(files)} input file(s), {tok}, {best_dtype(tok.vocab_size).name} tokens",
        file=sys.stderr,
    )
    return files


def main(argv=None) -> int:
    args = get_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallel over processes instead
    try:
        files = check_before_work(args)
        t0 = time.perf_counter()
        if args.partitions > 1 and len(files) > 1:
            stats = run_partitions(files, args)
        else:
            stats = process_files(files, args.output_prefix, args, args.workers)
        write_sidecars(args, stats)
    except (InputError, ValueError, OSError) as exc:
        print(f"error: {exc}\nno output written", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr)
        return 130
    dt = time.perf_counter() - t0
    print(
        f"done: {stats['docs']:,} documents, {stats['tokens']:,} tokens in {dt:.1f}s "
        f"({stats['docs'] / dt:,.0f} docs/s, {stats['tokens'] / dt:,.0f} tokens/s)",
        file=sys.stderr,
    )
    if stats["bad"]:
        print(f"skipped {stats['bad']} bad line(s); first:", file=sys.stderr)
        for line in stats["bad_lines"]:
            print(f"  {line}", file=sys.stderr)
    for p in output_prefixes(args.output_prefix, args.json_keys).values():
        print(f"wrote {p}.bin, {p}.idx and {p}.tokenizer.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
