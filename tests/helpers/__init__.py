"""What several test files share: the worker modules that multi-process tests spawn (`python -m tests.helpers.x`),
fault injection, planted corpora, the prewarmed process server and the test order of `make test`."""
