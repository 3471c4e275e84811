"""The ``prefixcache`` command line."""
