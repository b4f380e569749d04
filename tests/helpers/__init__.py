"""What the tests share: set-up, input draws, lowering for an accelerator, and the scripts some
tests run in a process of their own. Tests import these, never each other (tests/project/test_architecture.py)."""
