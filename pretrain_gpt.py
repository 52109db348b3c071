#!/usr/bin/env python3
"""Pretrain a GPT with megafp8: parse -> validate -> build -> train. Flags as Megatron-LM's."""

from megafp8.run_hooks import end_process
from megafp8.train import main

if __name__ == "__main__":
    end_process(main())  # exits without the interpreter's finalization: see its docstring
