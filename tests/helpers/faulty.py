"""An entry point with one fault injected, for the fault tests (tests/lab/test_distributed.py,
tests/lab/test_hf_import.py): `python tests/helpers/faulty.py ENTRY --fault=KIND:N [ENTRY's flags]`, ENTRY
train or import_checkpoint.
  read:N       (train) this process's N-th batch read fails with an OSError, as a data read
               failing on one host would
  slow_save:S  (import_checkpoint) the import's save waits S seconds first, while its
               unfinished folder exists, so that a signal can land there"""

import importlib
import signal
import sys
import time

from absl import app, flags

from data import pipeline
from lab import cli, hf

ENTRY = importlib.import_module(sys.argv.pop(1))

FAULT = flags.DEFINE_string("fault", "", "KIND:N, see the module's doc")


def main(argv):
    # Ctrl-C as at a terminal: a shell starts a background job (`make test &`, a CI runner's)
    # with SIGINT ignored, pytest's workers pass that on, and Python keeps an ignored SIGINT, so
    # the tests' SIGINT would be lost.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    kind, _, n = FAULT.value.partition(":")
    if kind == "read":
        read, count = pipeline.Streams.__next__, [0]

        def failing(self):
            count[0] += 1
            if count[0] == int(n):
                raise OSError(f"injected: reading batch {n} failed")
            return read(self)

        pipeline.Streams.__next__ = failing
    elif kind == "slow_save":
        save = hf.save

        def slow(*args, **kwargs):
            time.sleep(float(n))
            return save(*args, **kwargs)

        hf.save = slow
    ENTRY.main(argv)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
