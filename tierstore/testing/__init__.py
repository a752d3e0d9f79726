"""Test support shipped with the package: the tier conformance suite, shared test data and a local S3 server."""
