#!/usr/bin/env python3
"""Concatenate MMIDIDX datasets, in order, into one (Megatron's ``tools/merge_datasets.py``).

    python3 data_tools/merge_datasets.py --input shards/ --output-prefix data/all_text_document
    python3 data_tools/merge_datasets.py --input a_text_document b_text_document --output-prefix ab

``--input`` is a directory (every ``*.idx`` with its ``.bin``, sorted by name) or dataset prefixes.
Every input is validated and their dtypes compared before anything is written; byte pointers and
document offsets are int64, so merged datasets may pass 4 G tokens. The ``.bin`` data is copied in
blocks (holes of sparse files kept), the index spooled: memory stays bounded. Output is written
under temporary names and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megafp8.data.indexed import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetWriter,
    IndexFormatError,
    dataset_exists,
)


def input_prefixes(specs: list[str]) -> list[str]:
    """Dataset prefixes from directories (sorted ``*.idx``) and explicit prefixes."""
    prefixes = []
    for spec in specs:
        if os.path.isdir(spec):
            found = sorted(
                os.path.join(spec, f[:-4]) for f in os.listdir(spec) if f.endswith(".idx")
            )
            if not found:
                raise ValueError(f"{spec}: no .idx file in this directory")
            prefixes.extend(found)
        else:
            prefix = spec[:-4] if spec.endswith((".idx", ".bin")) else spec
            if not dataset_exists(prefix):
                raise ValueError(f"{prefix}: no {prefix}.bin/.idx pair")
            prefixes.append(prefix)
    return prefixes


def merge(prefixes: list[str], output_prefix: str) -> IndexedDataset:
    """Validate every input, check dtypes agree, then write the concatenation."""
    if not prefixes:
        raise ValueError("nothing to merge")
    out = os.path.abspath(output_prefix)
    if out in {os.path.abspath(p) for p in prefixes}:
        raise ValueError(f"{output_prefix}: output is also an input")
    datasets = [IndexedDataset(p) for p in prefixes]
    dtypes = {ds.dtype for ds in datasets}
    if len(dtypes) > 1:
        detail = ", ".join(f"{p}: {ds.dtype}" for p, ds in zip(prefixes, datasets, strict=True))
        raise ValueError(f"inputs have different token dtypes ({detail})")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with IndexedDatasetWriter(output_prefix, datasets[0].dtype) as w:
        for p in prefixes:
            w.add_index(p)
    return IndexedDataset(output_prefix)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="directory or dataset prefixes")
    p.add_argument("--output-prefix", required=True)
    args = p.parse_args(argv)
    try:
        prefixes = input_prefixes(args.input)
        merged = merge(prefixes, args.output_prefix)
    except (ValueError, IndexFormatError, OSError) as exc:
        print(f"error: {exc}\nno output written", file=sys.stderr)
        return 1
    print(
        f"merged {len(prefixes)} dataset(s) into {args.output_prefix}: {len(merged):,} "
        f"sequences, {merged.num_documents:,} documents, {merged.num_tokens:,} tokens",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
