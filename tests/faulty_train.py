"""train.py with one fault injected into this process, for tests/test_distributed.py's fault
tests: `--fault=read:N` makes this process's N-th batch read fail with an OSError (a data read
failing on one host), the other flags are train.py's."""

import sys

from absl import app, flags

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

import train  # noqa: E402 - after the path
from data import pipeline  # noqa: E402
from lab import cli  # noqa: E402

FAULT = flags.DEFINE_string("fault", "", "read:N: the N-th batch read fails")


def main(argv):
    kind, _, n = FAULT.value.partition(":")
    if kind == "read":
        read, count = pipeline.Streams.__next__, [0]

        def failing(self):
            count[0] += 1
            if count[0] == int(n):
                raise OSError(f"injected: reading batch {n} failed")
            return read(self)

        pipeline.Streams.__next__ = failing
    train.main(argv)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
