#!/usr/bin/env python3
"""Train a sentencepiece BPE or unigram tokenizer from JSONL (chosen keys) or plain text files.

    python3 data_tools/train_tokenizer.py --input corpus.jsonl --output-prefix tok/demo \\
        --vocab-size 4096 --model-type bpe --byte-fallback

Writes ``{prefix}.model``, ``{prefix}.vocab`` and ``{prefix}.json`` (a manifest: inputs, options,
special ids, sentence counts, the model's sha256), each under a temporary name renamed when done.

Special pieces: ``<unk>`` 0, ``<s>`` (BOS) 1, ``<EOD>`` (the eos piece) 2, ``<pad>`` 3 (unless
``--no-pad``), all control symbols: text never encodes to them. EOD is id 2 for every
SentencePiece type, current or legacy: Megatron's current wrappers take the eos id, and its
legacy ``SentencePieceTokenizer`` (``--tokenizer-sentencepiece-legacy``) finds ``<EOD>`` in the
vocab instead of appending one (it still appends ``<CLS> <SEP> <MASK>``, so the legacy vocab is
3 larger, and splits those names out of the text). The manifest lists both.

Memory stays bounded on any input: documents are split into lines (long lines cut into chunks of
``--max-sentence-length`` characters) and a seeded reservoir sample of ``--max-sentences`` lines
is all that is kept and handed to the trainer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megafp8.data.jsonl import SUFFIXES, InputError, expand_inputs, iter_texts  # noqa: E402

TEXT_SUFFIXES = (".txt",)


def get_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="JSONL (.jsonl/.gz/.zst) or .txt files, globs or directories",
    )
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL keys holding text")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model/.vocab/.json")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    p.add_argument(
        "--byte-fallback",
        action="store_true",
        help="unknown characters become UTF-8 byte pieces instead of <unk>",
    )
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument(
        "--normalization",
        choices=("identity", "nmt_nfkc", "nfkc"),
        default="identity",
        help="identity keeps the text exactly as given (default)",
    )
    p.add_argument("--no-pad", action="store_true", help="no <pad> piece")
    p.add_argument(
        "--user-defined-symbols", nargs="*", default=[], help="extra pieces always kept whole"
    )
    p.add_argument(
        "--max-sentences",
        type=int,
        default=2_000_000,
        help="lines sampled (reservoir) for training; bounds memory",
    )
    p.add_argument(
        "--max-sentence-length",
        type=int,
        default=8192,
        help="longer lines are cut into chunks of this many characters",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--skip-bad-lines", action="store_true")
    p.add_argument("--verbose", action="store_true", help="show sentencepiece's own log")
    args = p.parse_args(argv)
    if args.vocab_size < 8:
        p.error("--vocab-size must be >= 8")
    if not 0 < args.character_coverage <= 1:
        p.error("--character-coverage must be in (0, 1]")
    if args.max_sentences < 1 or args.max_sentence_length < 16:
        p.error("--max-sentences must be >= 1 and --max-sentence-length >= 16")
    return args


def iter_lines(paths, keys, max_len: int, skip_bad: bool, bad: list):
    """Non-empty lines of every document (JSONL) or text file, long ones cut in chunks."""
    for path in paths:
        if path.endswith(SUFFIXES):
            raw = (ln for doc in iter_texts([path], keys, skip_bad, bad) for ln in doc.splitlines())
            yield from _chunks(raw, max_len)
        else:
            with open(path, encoding="utf-8", errors="strict") as f:  # streamed, line by line
                yield from _chunks(f, max_len)


def _chunks(lines, max_len: int):
    for line in lines:
        line = line.strip()
        for i in range(0, len(line), max_len):
            yield line[i : i + max_len]


def reservoir(items, k: int, seed: int) -> tuple[list, int]:
    """A uniform sample of ``k`` items from a stream (Algorithm R) and the stream's length."""
    rng = random.Random(seed)
    sample: list = []
    n = 0
    for n, item in enumerate(items, 1):
        if n <= k:
            sample.append(item)
        else:
            j = rng.randrange(n)
            if j < k:
                sample[j] = item
    return sample, n


def train(args, sentences: list[str]) -> None:
    import sentencepiece as spm

    spm.set_random_generator_seed(args.seed)
    tmp = f"{args.output_prefix}.tmp-{os.getpid()}"
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_prefix=tmp,
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            byte_fallback=args.byte_fallback,
            character_coverage=args.character_coverage,
            normalization_rule_name=args.normalization,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1 if args.no_pad else 3,
            unk_piece="<unk>",
            bos_piece="<s>",
            eos_piece="<EOD>",
            pad_piece="<pad>",
            user_defined_symbols=args.user_defined_symbols or None,
            max_sentence_length=4 * args.max_sentence_length + 16,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=args.num_threads,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=args.normalization != "identity",
            minloglevel=0 if args.verbose else 2,
        )
    except RuntimeError as exc:
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp + ext):
                os.remove(tmp + ext)
        raise ValueError(
            f"sentencepiece training failed: {exc} (a smaller --vocab-size or "
            "more text usually helps)"
        ) from exc
    os.replace(tmp + ".vocab", args.output_prefix + ".vocab")
    os.replace(tmp + ".model", args.output_prefix + ".model")


def megatron_view(model: str) -> dict:
    """Vocab size and EOD id of each Megatron SentencePiece type over ``model``."""
    from megafp8.data.tokenizer import make_tokenizer

    view = {}
    for name in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        for legacy in (False, True):
            tok = make_tokenizer(name, model, legacy=legacy)
            key = name + (" --tokenizer-sentencepiece-legacy" if legacy else "")
            view[key] = {"vocab_size": tok.vocab_size, "eod": tok.eod}
    return view


def write_manifest(args, files, seen: int, sampled: int, bad: list, seconds: float) -> dict:
    import sentencepiece as spm

    model = args.output_prefix + ".model"
    sp = spm.SentencePieceProcessor(model_file=model)
    with open(model, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    manifest = {
        "model": os.path.basename(model),
        "sha256": digest,
        "inputs": files,
        "json_keys": args.json_keys,
        "vocab_size": sp.GetPieceSize(),
        "model_type": args.model_type,
        "byte_fallback": args.byte_fallback,
        "normalization": args.normalization,
        "character_coverage": args.character_coverage,
        "special_ids": {
            "unk": sp.unk_id(),
            "bos": sp.bos_id(),
            "eod": sp.eos_id(),
            "pad": sp.pad_id(),
        },
        "megatron": megatron_view(model),
        "lines_seen": seen,
        "lines_sampled": sampled,
        "bad_lines_skipped": len(bad),
        "seed": args.seed,
        "seconds": round(seconds, 2),
        "sentencepiece_version": spm.__version__,
    }
    tmp = f"{args.output_prefix}.json.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, args.output_prefix + ".json")
    return manifest


def main(argv=None) -> int:
    args = get_args(argv)
    t0 = time.perf_counter()
    bad: list = []
    try:
        files = expand_inputs(args.input, SUFFIXES + TEXT_SUFFIXES)
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
        lines = iter_lines(
            files, args.json_keys, args.max_sentence_length, args.skip_bad_lines, bad
        )
        sample, seen = reservoir(lines, args.max_sentences, args.seed)
        if not sample:
            raise InputError(f"no text found in {len(files)} input file(s)")
        print(
            f"training a {args.model_type} model of {args.vocab_size} pieces on "
            f"{len(sample):,} of {seen:,} lines",
            file=sys.stderr,
        )
        train(args, sample)
        manifest = write_manifest(args, files, seen, len(sample), bad, time.perf_counter() - t0)
    except (InputError, ValueError, OSError, UnicodeDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if bad:
        print(f"skipped {len(bad)} bad line(s), first: {bad[0]}", file=sys.stderr)
    print(
        f"wrote {args.output_prefix}.model ({manifest['vocab_size']} pieces, "
        f"eod={manifest['special_ids']['eod']}) in {manifest['seconds']}s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
