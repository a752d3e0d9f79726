"""Test support shipped with the package: the tier conformance suite and a local S3 server."""
