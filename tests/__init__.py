"""The test suite; its folders mirror the package's (see helpers.py for what they share)."""
