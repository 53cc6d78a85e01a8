"""Run a longsft curriculum.

    torchrun --nproc_per_node=2 launch/curriculum.py recipe=tiny
    torchrun --nproc_per_node=8 launch/curriculum.py recipe=qwen3_32b model.path=/models/Qwen3-32B

Arguments are ``key=value`` overrides of the recipe (``recipe=`` picks it; default ``tiny``).
A bad key, value or data file exits with status 2 and a message naming it, before any training.
"""

import sys

from longsft.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
