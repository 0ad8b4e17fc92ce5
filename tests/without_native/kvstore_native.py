"""Stands in for kvstore_native when this directory leads PYTHONPATH: `make test`'s pass over the pure-Python paths.

Importing it fails the way a missing build does, in the test process and in every node it starts,
so the SDK, the node and its page index take their fallbacks and the tests check them there.
"""

raise ImportError("kvstore_native is turned off for this run (tests/without_native leads PYTHONPATH)")
