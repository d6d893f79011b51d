"""Compression methods: one module per method (a `Method` subclass, kvmini.methods.method) and the
mechanisms several share, as functions (selectors, allocators, the papers' equations).

The registry of named methods is `kvmini.methods.registry`.
"""
