"""Token data: Megatron .bin/.idx datasets, GPT samples, blends, loaders and tokenizers."""

from megafp8.data.loader import DataIterators, build_data_iterators, build_datasets
from megafp8.data.tokenizer import DEFAULT_MOCK_VOCAB_SIZE, build_tokenizer

__all__ = [
    "DataIterators",
    "build_data_iterators",
    "build_datasets",
    "build_tokenizer",
    "DEFAULT_MOCK_VOCAB_SIZE",
]
