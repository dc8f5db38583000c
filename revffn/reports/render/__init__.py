"""Renderers: Markdown tables and PNG plots from the runners' JSON (never re-measure)."""
