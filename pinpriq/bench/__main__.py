"""``python -m pinpriq.bench``: the same as ``pinpriq-bench``."""

from pinpriq.bench.cli import main

if __name__ == "__main__":
    main()
