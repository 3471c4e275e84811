"""``prefixcache proxy``: disaggregated prefill through the store, behind one OpenAI-compatible address."""
