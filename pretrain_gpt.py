#!/usr/bin/env python3
"""Pretrain a GPT with megafp8: parse -> validate -> build -> train. Flags as Megatron-LM's."""

import sys

from megafp8.train import main

if __name__ == "__main__":
    sys.exit(main())
