"""`python -m blis_jax run|replay ...`: the same CLI as the `blis-jax` command."""

import sys

from blis_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
