"""Operator tools for a running node: the `kvstore` command."""
