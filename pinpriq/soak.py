"""``python -m pinpriq.soak``, the command the README names: the soak test lives in
``pinpriq.bench.soak``, beside the bench; this module only runs it."""

from pinpriq.bench.soak import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
