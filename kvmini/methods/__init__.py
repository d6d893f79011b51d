"""Compression methods: reusable parts (scorers, allocators, selectors) and one module per method.

The registry of named methods is `kvmini.methods.registry`.
"""
