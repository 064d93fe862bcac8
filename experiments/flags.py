"""Library advice in command-line terms: chunkjax's errors name the Python arguments
(``device_budget >= 2.000GiB``); the command-line tools show them as their flags
(``--device-budget >= 2.000GiB``). The library never names a flag (issue 22, item 4)."""
from __future__ import annotations

import re

#: a chunkjax argument named in an error -> the flag of the tools that set it
FLAGS = {"device_budget": "--device-budget", "host_budget": "--host-budget", "chunk_size": "--chunk-size",
         "micro_batches": "--micro-batches", "zero_stage": "--zero-stage", "storage directories": "--storage DIR"}

_WORD = re.compile(r"(?<![\w-])(" + "|".join(FLAGS) + r")(?![\w=(])")


def with_flags(message: str) -> str:
    """``message`` with each argument name of :data:`FLAGS` written as its flag (whole words
    only; ``chunk_size=128`` and ``chunk_size(...)`` stay as they are)."""
    return _WORD.sub(lambda m: FLAGS[m.group(1)], message)
