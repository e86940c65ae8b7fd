"""Bridges to other libraries. ``kvpolicy.integrations.kvpress`` needs torch and kvpress (not
installed with kvpolicy); ``rectangular`` is what it uses to fit kvpolicy's ragged selections
into rectangular caches, with numpy only."""
