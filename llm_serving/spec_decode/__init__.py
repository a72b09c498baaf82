"""Speculative decoding with n-gram (prompt lookup) drafts, as vLLM's
``--speculative-config '{"method": "ngram", ...}'`` (docs/speculative.md)."""
